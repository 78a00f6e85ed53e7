//! Writes the values table of `charts/ferry/README.md` from the `# --` comments of
//! `charts/ferry/values.yaml`, and checks that `values.schema.json` knows the same keys.
//! `--check` only compares, and fails when the README is out of date.

use std::path::PathBuf;
use std::process::ExitCode;

use ferry_operator::valuesdoc;

fn main() -> ExitCode {
    let check = std::env::args().skip(1).any(|a| a == "--check");
    match run(check) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("valuesdoc: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(check: bool) -> Result<(), String> {
    let chart = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../charts/ferry"));
    let read = |name: &str| {
        std::fs::read_to_string(chart.join(name))
            .map_err(|e| format!("cannot read charts/ferry/{name}: {e}"))
    };
    let values_yaml = read("values.yaml")?;
    let table = valuesdoc::table(&values_yaml).map_err(|e| e.to_string())?;

    let values: serde_json::Value =
        serde_saphyr::from_str(&values_yaml).map_err(|e| format!("values.yaml: {e}"))?;
    let schema: serde_json::Value = serde_json::from_str(&read("values.schema.json")?)
        .map_err(|e| format!("values.schema.json: {e}"))?;
    let drift = valuesdoc::schema_drift(&values, &schema, &valuesdoc::documented(&values_yaml));
    if !drift.is_empty() {
        return Err(format!(
            "values.yaml and values.schema.json disagree:\n  {}",
            drift.join("\n  ")
        ));
    }

    let readme = read("README.md")?;
    let updated = valuesdoc::update_readme(&readme, &table).map_err(|e| e.to_string())?;
    if updated == readme {
        println!("charts/ferry/README.md: the values table is up to date");
        return Ok(());
    }
    if check {
        return Err(
            "charts/ferry/README.md: the values table differs from values.yaml; run `make chart-docs`"
                .to_owned(),
        );
    }
    std::fs::write(chart.join("README.md"), updated)
        .map_err(|e| format!("cannot write charts/ferry/README.md: {e}"))?;
    println!("wrote the values table of charts/ferry/README.md");
    Ok(())
}
