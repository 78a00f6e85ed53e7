//! Writes the values table of `charts/ferry/README.md` from the `# --` comments of
//! `charts/ferry/values.yaml`, and checks that `values.schema.json` knows the same keys; and
//! the Argo CD health checks from `charts/ferry/argocd/*.lua`.
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
    let (readme, updated) = valuesdoc::chart_readme(&chart)?;
    if updated == readme {
        println!("charts/ferry/README.md: the values table and the Argo CD checks are up to date");
        return Ok(());
    }
    if check {
        return Err(
            "charts/ferry/README.md: the values table or the Argo CD checks differ from values.yaml or argocd/; run `make chart-docs`"
                .to_owned(),
        );
    }
    std::fs::write(chart.join("README.md"), updated)
        .map_err(|e| format!("cannot write charts/ferry/README.md: {e}"))?;
    println!("wrote the values table and the Argo CD checks of charts/ferry/README.md");
    Ok(())
}
