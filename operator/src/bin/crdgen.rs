//! Writes the CRDs to `crds/` and `charts/ferry/crd-files/` (the chart renders them from there
//! in `templates/crds.yaml`), or to each directory given as an argument.

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    let dirs = if args.is_empty() {
        let root = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
        vec![root.join("crds"), root.join("charts/ferry/crd-files")]
    } else {
        args
    };
    let files = match ferry_operator::crdgen::render() {
        Ok(f) => f,
        Err(e) => {
            eprintln!("crdgen: {e}");
            return ExitCode::FAILURE;
        }
    };
    for dir in &dirs {
        for (name, yaml) in &files {
            let path = dir.join(name);
            if let Err(e) = std::fs::write(&path, yaml) {
                eprintln!("crdgen: cannot write {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
            println!("wrote {}", path.display());
        }
    }
    ExitCode::SUCCESS
}
