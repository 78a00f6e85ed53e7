//! The flood section: one tenant's large messages against the forwarder's memory, with the
//! default settings (a window of 1,000 messages and 16 MiB, messages up to 1 MiB). A backlog
//! of QoS 1 messages of 1 MiB (over `mqtt.max_message_bytes`: skipped unread, dropped by the
//! rule) and one of 900 KiB (under it: forwarded, the window held by its bytes), each drained
//! right after the forwarder starts; its peak RSS against the target, whatever the payloads.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{Context as _, Result};
use serde::{Deserialize, Serialize};

use crate::report::verdict;
use crate::{Bench, PARTITIONS, TOPICS};

/// The flood: 300 messages of 1 MiB.
const MESSAGES: u64 = 300;
const MIB: usize = 1024 * 1024;
/// Over the default `mqtt.max_message_bytes` (the topic makes the packet larger), and under it.
const SIZES: [usize; 2] = [MIB, 900 * 1024];
/// The forwarder's peak RSS under a flood, whatever the payloads.
pub const RSS_TARGET_MIB: f64 = 128.0;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Flood {
    /// Payload bytes of each message.
    pub size: usize,
    pub messages: u64,
    /// Records read back from Kafka.
    pub forwarded: u64,
    /// Messages the forwarder skipped unread (over `mqtt.max_message_bytes`).
    pub unread: u64,
    /// From the forwarder's start to its last ack.
    pub seconds: f64,
    pub peak_rss_mib: f64,
    pub lost: u64,
}

pub fn run(bench: &mut Bench) -> Result<Vec<Flood>> {
    println!(
        "\n== Flood: {MESSAGES} QoS 1 messages of 1 MiB, then of 900 KiB, default limits (window 1,000 messages / 16 MiB, messages up to 1 MiB)"
    );
    SIZES.iter().map(|&size| one(bench, size)).collect()
}

fn one(bench: &mut Bench, size: usize) -> Result<Flood> {
    let run = bench.next_run();
    let topic = format!("bench.{run}");
    bench
        .rt
        .block_on(bench.kafka.create_topic(&topic, PARTITIONS))?;
    let config = format!(
        "mqtt:\n  host: 127.0.0.1\n  port: {port}\n  client_id: bench-{run}\n  clean_session: false\n\
         kafka:\n  bootstrap_servers: \"{bootstrap}\"\n{kafka_config}\
         rules:\n  - name: flood\n    mqtt:\n      topics: [\"b{run}/#\"]\n    kafka:\n      topic: {topic}\n    on_unwritable: drop\n\
         log:\n  level: warn\n",
        port = bench.mqtt.port(),
        bootstrap = bench.kafka.bootstrap(),
        kafka_config = bench.kafka_config,
    );
    let reader = bench.filled_session(run, &config, (MESSAGES, size, TOPICS), topic)?;
    let (mut fwd, seconds) =
        bench.until_acked(run, &config, MESSAGES, Duration::from_millis(50), |_, _| {})?;
    let unread = fwd
        .metric("ferry_mqtt_unread_messages_total")
        .context("the forwarder's unread counter")?;
    let usage = fwd.usage()?;
    fwd.stop()?;
    let expected = MESSAGES - unread as u64;
    let arrivals = reader.finish(expected)?;
    let flood = Flood {
        size,
        messages: MESSAGES,
        forwarded: arrivals.records,
        unread: unread as u64,
        seconds,
        peak_rss_mib: usage.peak_rss_mib,
        lost: arrivals.lost,
    };
    println!("{}", flood.line());
    Ok(flood)
}

impl Flood {
    pub fn line(&self) -> String {
        format!(
            "{} × {} KiB: {} forwarded, {} unread, {:.1} s, peak RSS {:.1} MiB, lost {}",
            self.messages,
            self.size / 1024,
            self.forwarded,
            self.unread,
            self.seconds,
            self.peak_rss_mib,
            self.lost
        )
    }
}

/// The targets' row: the largest peak RSS of the floods.
pub fn target_row(floods: &[Flood], s: &mut String) {
    let Some(peak) = floods.iter().map(|f| f.peak_rss_mib).reduce(f64::max) else {
        return;
    };
    let _ = writeln!(
        s,
        "| forwarder peak RSS ≤ {RSS_TARGET_MIB:.0} MiB under a flood of {MESSAGES} × 1 MiB, whatever the payloads | {peak:.1} MiB (largest of the floods) | {} |",
        verdict(peak <= RSS_TARGET_MIB)
    );
}

pub fn table(floods: &[Flood], s: &mut String) {
    if floods.is_empty() {
        return;
    }
    let _ = writeln!(
        s,
        "\n### Flood: large messages, default limits\n\n\
         {MESSAGES} QoS 1 messages drained right after the forwarder starts, with the defaults: a window of 1,000 messages and 16 MiB, messages up to 1 MiB (the topic makes a 1 MiB payload's packet larger: skipped unread, dropped by the rule's `on_unwritable: drop`).\n\n\
         | payload | forwarded | unread | seconds | peak RSS MiB | lost |\n|---|---|---|---|---|---|"
    );
    for f in floods {
        let _ = writeln!(
            s,
            "| {} KiB | {} | {} | {:.1} | {:.1} | {} |",
            f.size / 1024,
            f.forwarded,
            f.unread,
            f.seconds,
            f.peak_rss_mib,
            f.lost
        );
    }
}
