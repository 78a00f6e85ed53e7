//! An idle producer costs next to nothing: its polling thread sleeps between deliveries
//! instead of spinning at the end of each poll. Fails without Ferry's rdkafka patch
//! (`third_party/rdkafka/FERRY-PATCH.md`), where the thread spun for up to 1 ms at the end of
//! every 100 ms poll.

use std::sync::Arc;
use std::time::Duration;

use ferry_api::config::KafkaConfig;
use ferry_forwarder::kafka;
use ferry_forwarder::metrics::Metrics;

/// The rdkafka `ThreadedProducer`'s thread ("producer polling thread", 15 bytes in `comm`).
const POLLING_THREAD: &str = "producer pollin";
/// The thread polls with a 100 ms deadline: 10 wakeups a second. Each should cost microseconds;
/// a quarter of a millisecond each is the bound, a quarter of what the spin cost.
const BOUND_PER_WAKEUP: Duration = Duration::from_micros(250);
const WAKEUPS_PER_SECOND: u32 = 10;

/// CPU time of this process's thread named `name`, from its schedstat (nanoseconds).
fn thread_cpu(name: &str) -> Duration {
    let tasks = std::fs::read_dir("/proc/self/task").expect("/proc/self/task");
    let mut found = None;
    for task in tasks {
        let dir = task.expect("task").path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if comm.trim_end() == name {
            let stat = std::fs::read_to_string(dir.join("schedstat")).expect("schedstat");
            let ns: u64 = stat
                .split_whitespace()
                .next()
                .and_then(|f| f.parse().ok())
                .expect("run time in schedstat");
            assert!(found.is_none(), "two threads named {name:?}");
            found = Some(Duration::from_nanos(ns));
        }
    }
    found.unwrap_or_else(|| panic!("no thread named {name:?} in this process"))
}

#[test]
fn an_idle_producers_polling_thread_sleeps_between_polls() {
    let config = KafkaConfig {
        // Nothing listens there: the producer stays idle, with nothing to deliver.
        bootstrap_servers: "127.0.0.1:9".into(),
        tls: None,
        sasl: None,
        config: Default::default(),
        allow_weaker_delivery: false,
    };
    let (reports, _keep_reports) = tokio::sync::mpsc::unbounded_channel();
    let (fatal, _keep_fatal) = tokio::sync::mpsc::unbounded_channel();
    let wiring = kafka::ProducerWiring {
        metrics: Arc::new(Metrics::new()),
        reports,
        fatal,
    };
    let producer = kafka::producer(&config, &wiring, 0).expect("producer");
    std::thread::sleep(Duration::from_millis(300));
    let seconds = 2;
    let before = thread_cpu(POLLING_THREAD);
    std::thread::sleep(Duration::from_secs(seconds));
    let used = thread_cpu(POLLING_THREAD) - before;
    let bound = BOUND_PER_WAKEUP * WAKEUPS_PER_SECOND * seconds as u32;
    eprintln!("polling thread: {used:?} of CPU in {seconds} s idle (bound {bound:?})");
    assert!(
        used <= bound,
        "the idle polling thread used {used:?} of CPU in {seconds} s (bound {bound:?}): it spins"
    );
    drop(producer);
}
