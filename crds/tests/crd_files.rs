//! The CRDs committed in the Helm chart are exactly what the Rust types generate.

use std::collections::BTreeSet;

#[test]
fn committed_crds_match_the_rust_types() {
    let dir = shardplane_testkit::repo_root().join("charts/shardplane/files/crds");
    let regenerate = "regenerate them with `cargo run -p shardplane -- crds --dir charts/shardplane/files/crds` and commit";
    let generated = shardplane_crds::crd_files().expect("CRDs serialize");
    for (file, yaml) in &generated {
        let path = dir.join(file);
        let committed = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{} cannot be read ({e}): {regenerate}", path.display()));
        assert!(
            committed == *yaml,
            "{} differs from the CRD the Rust types generate: {regenerate}",
            path.display()
        );
    }
    let on_disk: BTreeSet<String> = std::fs::read_dir(&dir)
        .expect("crds directory exists")
        .map(|e| {
            e.expect("readable entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    let expected: BTreeSet<String> = generated.into_iter().map(|(f, _)| f).collect();
    assert_eq!(
        on_disk,
        expected,
        "stray or missing files in {}: {regenerate}",
        dir.display()
    );
}

#[test]
fn every_crd_has_status_printer_columns_short_name_and_category() {
    for crd in shardplane_crds::all_crds() {
        let name = crd.metadata.name.clone().unwrap_or_default();
        let names = &crd.spec.names;
        assert_eq!(
            names.categories.as_deref(),
            Some(&["shardplane".to_string()][..]),
            "{name}"
        );
        assert!(
            names.short_names.as_ref().is_some_and(|s| !s.is_empty()),
            "{name} has no short name"
        );
        let version = &crd.spec.versions[0];
        assert_eq!(version.name, "v1alpha1");
        assert!(
            version
                .additional_printer_columns
                .as_ref()
                .is_some_and(|c| c.len() >= 4),
            "{name} needs printer columns"
        );
        let schema = serde_json::to_value(version.schema.as_ref().unwrap()).unwrap();
        assert_no_undocumented_fields(
            &schema["openAPIV3Schema"]["properties"]["spec"],
            &format!("{name}.spec"),
        );
        if name != "shardingstrategies.shardplane.dev" {
            assert!(
                version
                    .subresources
                    .as_ref()
                    .and_then(|s| s.status.as_ref())
                    .is_some(),
                "{name} has no status subresource"
            );
            assert_no_undocumented_fields(
                &schema["openAPIV3Schema"]["properties"]["status"],
                &format!("{name}.status"),
            );
        }
    }
}

/// Every field a user can write or read carries a description (`kubectl explain`).
fn assert_no_undocumented_fields(schema: &serde_json::Value, path: &str) {
    let Some(props) = schema.get("properties").and_then(|p| p.as_object()) else {
        if let Some(items) = schema.get("items") {
            assert_no_undocumented_fields(items, &format!("{path}[]"));
        }
        return;
    };
    for (field, sub) in props {
        let p = format!("{path}.{field}");
        assert!(sub.get("description").is_some(), "{p} has no description");
        assert_no_undocumented_fields(sub, &p);
    }
}

#[test]
fn scale_subresource_points_at_replicas_and_selector() {
    let crd = shardplane_crds::all_crds()
        .into_iter()
        .find(|c| c.spec.names.kind == "ModelDeployment")
        .unwrap();
    let scale = crd.spec.versions[0]
        .subresources
        .as_ref()
        .unwrap()
        .scale
        .as_ref()
        .unwrap();
    assert_eq!(scale.spec_replicas_path, ".spec.replicas");
    assert_eq!(scale.status_replicas_path, ".status.replicas");
    assert_eq!(
        scale.label_selector_path.as_deref(),
        Some(".status.selector")
    );
}
