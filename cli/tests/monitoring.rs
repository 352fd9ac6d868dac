//! The alerting rules parse and behave as their unit tests say, under the
//! real `promtool` (Debian's prometheus package, installed by scripts/setup.sh),
//! and every alert links its own section of docs/runbooks.md.

use std::process::Command;

use serde_json::Value;

/// Where the alerts' `runbook_url`s point, up to the anchor.
const RUNBOOKS: &str = "https://github.com/shardplane/shardplane/blob/main/docs/runbooks.md#";

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
    assert!(checked.contains("SUCCESS: 9 rules found"), "{checked}");
    let tested = promtool(&["test", "rules", "alerts-test.yaml"]);
    assert!(tested.contains("SUCCESS"), "{tested}");
}

/// The anchor GitHub gives a Markdown heading: lowercased, spaces made `-`,
/// punctuation other than `-` and `_` dropped.
fn github_anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

#[test]
fn every_alert_links_its_runbook_section() {
    let root = shardplane_testkit::repo_root();
    let alerts: Value = serde_saphyr::from_str(
        &std::fs::read_to_string(root.join("monitoring/alerts.yaml")).unwrap(),
    )
    .unwrap();
    let runbooks = std::fs::read_to_string(root.join("docs/runbooks.md")).unwrap();
    let sections: Vec<&str> = runbooks
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .map(str::trim)
        .collect();
    let mut names = Vec::new();
    for group in alerts["groups"].as_array().expect("groups") {
        for rule in group["rules"].as_array().expect("rules") {
            let Some(name) = rule["alert"].as_str() else {
                continue; // a recording rule
            };
            assert!(
                sections.contains(&name),
                "docs/runbooks.md has no `## {name}` section"
            );
            let url = rule["annotations"]["runbook_url"]
                .as_str()
                .unwrap_or_else(|| panic!("{name} has no runbook_url annotation"));
            let anchor = url.strip_prefix(RUNBOOKS).unwrap_or_else(|| {
                panic!("{name}: runbook_url {url} does not start with {RUNBOOKS}")
            });
            assert_eq!(
                anchor,
                github_anchor(name),
                "{name}: runbook_url {url} does not point at its `## {name}` section"
            );
            names.push(name);
        }
    }
    assert!(!names.is_empty(), "no alerts in monitoring/alerts.yaml");
    for section in &sections {
        assert!(
            names.contains(section),
            "docs/runbooks.md has a section `## {section}` but no alert of that name"
        );
    }
}
