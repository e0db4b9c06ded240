//! Every `unsafe` in the project says why it is sound: an `unsafe fn` carries a `# Safety`
//! section (what its caller guarantees), every `unsafe` block and `unsafe impl` a `SAFETY:`
//! comment just above it.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            if !matches!(p.file_name().and_then(|n| n.to_str()), Some("target" | "corpus" | "artifacts")) {
                rust_files(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// `unsafe` as a keyword in the code part of a line (not in a comment or a string literal).
fn has_unsafe(line: &str) -> bool {
    let code = line.split("//").next().unwrap_or("");
    let mut in_str = false;
    let mut word = String::new();
    for c in code.chars() {
        if c == '"' {
            in_str = !in_str;
        }
        if !in_str && (c.is_alphanumeric() || c == '_') {
            word.push(c);
        } else {
            if word == "unsafe" {
                return true;
            }
            word.clear();
        }
    }
    word == "unsafe"
}

#[test]
fn every_unsafe_says_why_it_is_sound() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = Vec::new();
    rust_files(&root.join("crates"), &mut files);
    rust_files(&root.join("fuzz"), &mut files);
    assert!(files.len() > 40, "found only {} Rust files under {}", files.len(), root.display());
    let mut missing = Vec::new();
    let mut seen = 0;
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, l) in lines.iter().enumerate() {
            if !has_unsafe(l) || l.contains("unsafe_code") {
                continue;
            }
            seen += 1;
            let above = lines[i.saturating_sub(8)..=i].join("\n");
            let ok = if l.contains("unsafe fn") { above.contains("# Safety") } else { above.contains("SAFETY") };
            if !ok {
                missing.push(format!("{}:{}: {}", f.display(), i + 1, l.trim()));
            }
        }
    }
    assert!(seen > 50, "only {seen} unsafe sites found: is the scan looking in the right place?");
    assert!(missing.is_empty(), "unsafe without a safety comment:\n{}", missing.join("\n"));
}
