//! `sluice run --chat` and `sluice chat` on the tiny Qwen3 golden (a Hugging Face directory
//! whose tokenizer_config.json carries a ChatML template).

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

fn model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden/qwen3")
}

/// `sluice` with its three streams piped.
fn spawn(args: &[&str]) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn sluice(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = spawn(args);
    let input = stdin.unwrap_or("").to_string();
    let mut pipe = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || {
        let _ = pipe.write_all(input.as_bytes());
    });
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    out
}

fn run_json(extra: &[&str]) -> serde_json::Value {
    let m = model();
    let mut args = vec!["run", "--model", m.to_str().unwrap(), "-t", "1", "-n", "3", "--json"];
    args.extend_from_slice(extra);
    let out = sluice(&args, None);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn run_chat_wraps_the_prompt_in_the_template() {
    let plain = run_json(&["--prompt", "hello"]);
    let chat = run_json(&["--chat", "--prompt", "hello"]);
    let system = run_json(&["--chat", "--system", "be brief", "--prompt", "hello"]);
    let (p, c, s) = (
        plain["prompt_tokens"].as_u64().unwrap(),
        chat["prompt_tokens"].as_u64().unwrap(),
        system["prompt_tokens"].as_u64().unwrap(),
    );
    // "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n": 7 tokens of markup around it.
    assert!(c > p && s > c, "plain {p}, chat {c}, with system {s}");

    // --chat-template: a file, or llama.cpp's ChatML.
    let dir = sluice_formats::scratch_root().join(format!("sluice-cli-chat-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("t.jinja");
    std::fs::write(&f, "{{ messages[0].content }}").unwrap();
    let own = run_json(&["--chat", "--chat-template", f.to_str().unwrap(), "--prompt", "hello"]);
    assert_eq!(own["prompt_tokens"], plain["prompt_tokens"]);
    let chatml = run_json(&["--chat", "--chat-template", "chatml", "--prompt", "hello"]);
    assert_eq!(chatml["prompt_tokens"], chat["prompt_tokens"]);
    // A template error names the file and the line.
    std::fs::write(&f, "ok\n{{ raise_exception('no such thing') }}").unwrap();
    let m = model();
    let out = sluice(
        &["run", "--model", m.to_str().unwrap(), "--chat", "--chat-template", f.to_str().unwrap(), "--prompt", "x"],
        None,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("t.jinja") && err.contains("line 2") && err.contains("no such thing"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn chat_flags_without_chat_are_refused() {
    let m = model();
    let out = sluice(&["run", "--model", m.to_str().unwrap(), "--system", "s", "--prompt", "x"], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--chat"), "{err}");
}

#[test]
fn chat_reads_one_message_per_line_and_keeps_the_history() {
    let m = model();
    let out = sluice(
        &["chat", "--model", m.to_str().unwrap(), "-t", "1", "-n", "4", "--stats", "--system", "sys"],
        Some("first\n\nsecond\n/reset\nthird\n/exit\nnever\n"),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let turns: Vec<&str> = err.lines().filter(|l| l.contains("prompt tokens,")).collect();
    assert_eq!(turns.len(), 3, "{err}");
    let field = |line: &str, name: &str| -> u64 {
        let before = line.split(name).next().unwrap();
        before.trim_end().rsplit(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
    };
    // The second turn's prompt holds the first exchange, and most of it is reused; after
    // /reset the prompt is short again but its system part is still reused.
    let (p1, p2, p3) =
        (field(turns[0], " prompt tokens"), field(turns[1], " prompt tokens"), field(turns[2], " prompt tokens"));
    assert!(p2 > p1 && p3 < p2, "{err}");
    assert_eq!(field(turns[0], " reused"), 0);
    assert!(field(turns[1], " reused") >= p1, "{err}");
    assert!(field(turns[2], " reused") > 0, "{err}");
}

/// `sluice run … | head -c 1` and the like: once the output's reader is gone, the generation
/// stops and the command ends quietly (no panic about a failed write), `run` and `chat` alike,
/// and a subcommand that only prints ends quietly too.
#[test]
fn a_closed_output_ends_the_command_quietly() {
    let m = model();
    let runs: [(&[&str], &str); 3] = [
        (&["run", "--model", m.to_str().unwrap(), "-t", "1", "-n", "40", "--prompt", "hello"], ""),
        (&["chat", "--model", m.to_str().unwrap(), "-t", "1", "-n", "40"], "hello\nand again\n"),
        // A subcommand that prints with std's macros.
        (&["inspect", m.to_str().unwrap()], ""),
    ];
    for (args, input) in runs {
        let mut child = spawn(args);
        // The reader goes away before anything is written.
        drop(child.stdout.take());
        let mut pipe = child.stdin.take().unwrap();
        let _ = pipe.write_all(input.as_bytes());
        drop(pipe);
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && !err.contains("panicked"), "{args:?}: {:?}\n{err}", out.status);
        if args[0] == "run" {
            // Stopped at the first token it could not write, not after all forty.
            assert!(err.contains("stop: cancelled"), "{err}");
        }
    }
}
