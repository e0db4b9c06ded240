//! The README's benchmark tables are generated from bench/results/*.json by bench/readme.py;
//! a table typed by hand, or a result added without regenerating them, fails here.

use std::path::PathBuf;
use std::process::Command;

#[test]
fn readme_benchmark_tables_match_the_results() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = match Command::new("python3").arg("bench/readme.py").arg("--check").current_dir(&root).output() {
        Ok(out) => out,
        Err(e) => panic!(
            "could not run python3 ({e}): checking README.md's benchmark tables against bench/results needs \
             python3 (standard library only) on PATH"
        ),
    };
    assert!(
        out.status.success(),
        "README.md's benchmark section differs from what bench/results implies; run `python3 bench/readme.py` \
         and commit the result\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
