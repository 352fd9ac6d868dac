//! The alerting rules parse and behave as their unit tests say, under the
//! real `promtool` (Debian's prometheus package, installed by scripts/setup.sh).

use std::process::Command;

fn promtool(args: &[&str]) -> String {
    let dir = shardplane_testkit::repo_root().join("monitoring");
    let out = Command::new("promtool")
        .args(args)
        .current_dir(&dir)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "promtool is missing ({e}): run `bash scripts/setup.sh` (Debian package prometheus)"
            )
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

#[test]
fn the_alerting_rules_are_valid_and_pass_their_unit_tests() {
    let checked = promtool(&["check", "rules", "alerts.yaml"]);
    assert!(checked.contains("SUCCESS: 5 rules found"), "{checked}");
    let tested = promtool(&["test", "rules", "alerts-test.yaml"]);
    assert!(tested.contains("SUCCESS"), "{tested}");
}
