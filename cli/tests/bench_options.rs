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
    for (options, refusal) in [
        (&["--top-p", "0.9"][..], "--top-p acts only when sampling"),
        (
            &["--temperature", "1", "--top-p", "1.5"][..],
            "top_p 1.5 must be above 0 and at most 1",
        ),
        // Through a gateway the requests are greedy: a top_p is refused.
        (
            &[
                "--gateway",
                "http://127.0.0.1:9",
                "--gateway-model",
                "m",
                "--top-p",
                "0.9",
            ][..],
            "cannot be used with",
        ),
    ] {
        let out = shardplane(&[&["bench", "--model", missing][..], options].concat());
        assert!(!out.status.success(), "{options:?}");
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(e.contains(refusal), "{options:?}: {e}");
    }
}
