//! `shardplane bench` checks its options before it loads anything: a
//! sampling option it would not use is refused, not ignored.

use std::process::{Command, Output};

fn shardplane(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shardplane"))
        .args(args)
        .env_remove("SHARDPLANE_MODEL")
        .output()
        .expect("the binary runs")
}

#[test]
fn bench_refuses_a_top_p_it_would_not_use_before_loading_anything() {
    let missing = "/nonexistent/model.gguf";
    let greedy = shardplane(&["bench", "--model", missing, "--top-p", "0.9"]);
    assert!(!greedy.status.success());
    let e = String::from_utf8_lossy(&greedy.stderr);
    assert!(e.contains("--top-p acts only when sampling"), "{e}");
    let out_of_range = shardplane(&[
        "bench",
        "--model",
        missing,
        "--temperature",
        "1",
        "--top-p",
        "1.5",
    ]);
    assert!(!out_of_range.status.success());
    let e = String::from_utf8_lossy(&out_of_range.stderr);
    assert!(e.contains("top_p 1.5 must be above 0 and at most 1"), "{e}");
    // Through a gateway the requests are greedy: a top_p is refused.
    let gateway = shardplane(&[
        "bench",
        "--model",
        missing,
        "--gateway",
        "http://127.0.0.1:9",
        "--gateway-model",
        "m",
        "--top-p",
        "0.9",
    ]);
    assert!(!gateway.status.success());
    let e = String::from_utf8_lossy(&gateway.stderr);
    assert!(e.contains("cannot be used with"), "{e}");
}
