//! Reads the Kafka version from `kafka/pom.xml`, the one place it is written (`install.sh`
//! fetches the jars of that version), into `FERRY_KAFKA_VERSION` for `KAFKA_VERSION`.

use std::fs;

const POM: &str = "kafka/pom.xml";

fn main() {
    println!("cargo:rerun-if-changed={POM}");
    let pom = fs::read_to_string(POM).unwrap_or_else(|e| panic!("read e2e/{POM}: {e}"));
    let version = pom
        .split_once("<kafka.version>")
        .and_then(|(_, rest)| rest.split_once("</kafka.version>"))
        .map(|(version, _)| version.trim())
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| panic!("e2e/{POM} names no <kafka.version>"));
    println!("cargo:rustc-env=FERRY_KAFKA_VERSION={version}");
}
