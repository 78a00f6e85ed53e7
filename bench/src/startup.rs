//! The first seconds after a start: a backlog of QoS 1 messages of 300 B on 50 MQTT topics
//! (the case after a crash or a rollout), drained by a forwarder started on it. How many are
//! acked by each of the first seconds, and the rate over them against the whole drain's: a
//! start that judges every record alone while its topic's limit is asked shows as a slow
//! first second or two.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::Result;
use serde::{Deserialize, Serialize};

use crate::{Bench, PARTITIONS};

/// Messages of the backlog, and MQTT topics they are spread over (issue 36's case).
const BACKLOG: u64 = 100_000;
const MQTT_TOPICS: u64 = 50;
const SIZE: usize = 300;
/// The marks, in seconds after the forwarder's process started.
const MARKS: [f64; 5] = [1.0, 2.0, 3.0, 5.0, 10.0];
/// How often the forwarder's acks are read.
const POLL: Duration = Duration::from_millis(20);

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Startup {
    pub messages: u64,
    /// Acked by each of [`MARKS`] (the total once all were acked).
    pub acked_by: Vec<(f64, u64)>,
    /// From the start to the first ack, and to the last.
    pub first_ack_seconds: f64,
    pub all_acked_seconds: f64,
    pub lost: u64,
}

impl Startup {
    /// Messages acked within the first second, and within the second (the full-speed rate,
    /// when the drain lasts that long).
    fn first_two_seconds(&self) -> (u64, u64) {
        let at = |t: f64| {
            self.acked_by
                .iter()
                .find(|(s, _)| (*s - t).abs() < f64::EPSILON)
                .map_or(0, |(_, n)| *n)
        };
        (at(1.0), at(2.0).saturating_sub(at(1.0)))
    }

    pub fn line(&self) -> String {
        let marks: Vec<String> = self
            .acked_by
            .iter()
            .map(|(s, n)| format!("{n} by {s:.0} s"))
            .collect();
        format!(
            "{} messages: first ack {:.2} s, all {:.2} s; {}; lost {}",
            self.messages,
            self.first_ack_seconds,
            self.all_acked_seconds,
            marks.join(", "),
            self.lost
        )
    }

    pub fn section(&self, s: &mut String) {
        let (first, second) = self.first_two_seconds();
        let _ = writeln!(
            s,
            "\n### The first seconds after a start\n\n\
             A backlog of {} QoS 1 messages of {SIZE} B on {MQTT_TOPICS} MQTT topics, drained by a forwarder started on it (window 1,000), counted by the seconds after its process started. The first ack came {:.2} s after the start, the last {:.2} s ({:.0} msg/s over the whole drain). The first second (connections, the topics' limits asked) acked {first}, the second {second} ({:.2}×). Lost: {}.\n\n\
             | seconds after start | acked by then |\n|---|---|",
            self.messages,
            self.first_ack_seconds,
            self.all_acked_seconds,
            self.messages as f64 / self.all_acked_seconds.max(0.001),
            first as f64 / (second.max(1)) as f64,
            self.lost
        );
        for (secs, n) in &self.acked_by {
            let _ = writeln!(s, "| {secs:.0} | {n} |");
        }
    }
}

pub fn run(bench: &mut Bench) -> Result<Startup> {
    println!(
        "\n== The first seconds after a start: {BACKLOG} QoS 1 messages of {SIZE} B on {MQTT_TOPICS} topics"
    );
    bench.broker_inflight(bench.window)?;
    let run = bench.next_run();
    let topic = format!("bench.{run}");
    bench
        .rt
        .block_on(bench.kafka.create_topic(&topic, PARTITIONS))?;
    let config = format!(
        "mqtt:\n  host: 127.0.0.1\n  port: {port}\n  client_id: bench-{run}\n  clean_session: false\n  max_inflight: {window}\n\
         kafka:\n  bootstrap_servers: \"{bootstrap}\"\n{kafka_config}\
         rules:\n  - name: start\n    mqtt:\n      topics: [\"b{run}/#\"]\n    kafka:\n      topic: {topic}\n\
         log:\n  level: warn\n",
        port = bench.mqtt.port(),
        window = bench.window,
        bootstrap = bench.kafka.bootstrap(),
        kafka_config = bench.kafka_config,
    );
    let reader = bench.filled_session(run, &config, (BACKLOG, SIZE, MQTT_TOPICS), topic)?;
    let (mut acked_by, mut marks) = (Vec::new(), MARKS.iter().peekable());
    let mut first_ack: Option<f64> = None;
    let (mut fwd, all) = bench.until_acked(run, &config, BACKLOG, POLL, |t, acked| {
        if acked > 0 && first_ack.is_none() {
            first_ack = Some(t);
        }
        while let Some(mark) = marks.next_if(|m| **m <= t) {
            acked_by.push((*mark, acked));
        }
    })?;
    for mark in marks {
        acked_by.push((*mark, BACKLOG));
    }
    fwd.stop()?;
    let arrivals = reader.finish(BACKLOG)?;
    let s = Startup {
        messages: BACKLOG,
        acked_by,
        first_ack_seconds: first_ack.unwrap_or(all),
        all_acked_seconds: all,
        lost: arrivals.lost,
    };
    println!("{}", s.line());
    Ok(s)
}
