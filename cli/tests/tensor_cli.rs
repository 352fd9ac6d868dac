//! `shardplane generate --tensor`: the ranks of a tensor group in processes
//! of their own (joined over loopback TCP, as across machines) give the
//! tokens one process gives; a rank process that dies ends the answer with
//! an error naming it, not a hang.

use std::io::Read;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn shardplane(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shardplane"))
        .args(args)
        .env_remove("SHARDPLANE_MODEL")
        .output()
        .expect("the binary runs")
}

/// The greedy tokens `generate` prints for `prompt` with `extra` options.
fn tokens(prompt: &str, extra: &[&str]) -> String {
    let model = shardplane_testkit::test_model();
    let mut args = vec![
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--chat",
        "--prompt",
        prompt,
        "--max-tokens",
        "24",
        "--dequantize",
        "--print-tokens",
    ];
    args.extend(extra);
    let out = shardplane(&args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{extra:?}: {stderr}");
    shardplane_testkit::tokens_line(&stderr)
}

#[test]
fn ranks_in_processes_of_their_own_give_the_tokens_of_one_process() {
    for prompt in [
        "Why is the sky blue?",
        "Write a haiku about the sea.",
        "Name three primary colors.",
    ] {
        let one = tokens(prompt, &[]);
        for extra in [
            &["--tensor", "3", "--tensor-processes"][..],
            &[
                "--tensor-weights",
                "2:1",
                "--tensor-processes",
                "--stages",
                "0-12,13-29",
            ][..],
        ] {
            assert_eq!(tokens(prompt, extra), one, "{prompt:?} with {extra:?}");
        }
    }
}

/// The processes `pid` started.
fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

#[test]
fn a_rank_process_that_dies_ends_the_answer_with_an_error_naming_it() {
    let model = shardplane_testkit::test_model();
    let mut leader = Command::new(env!("CARGO_BIN_EXE_shardplane"))
        .args(["generate", "--model", model.to_str().unwrap()])
        .args(["--prompt", "Once upon a time", "--max-tokens", "4000"])
        .args(["--tensor", "2", "--tensor-processes"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for the first words: the group is running.
    let mut first = [0u8; 8];
    leader
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut first)
        .unwrap();
    let ranks = children(leader.id());
    assert_eq!(ranks.len(), 1, "one rank process: {ranks:?}");
    Command::new("kill")
        .args(["-9", &ranks[0].to_string()])
        .status()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = leader.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the leader hangs after its rank died"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    leader
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("tensor group broken") && stderr.contains("rank 1"),
        "{stderr}"
    );
}
