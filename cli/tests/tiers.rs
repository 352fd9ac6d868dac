//! manifests/tiers: every overlay renders with `kubectl kustomize` and the
//! real API server accepts what it renders (server dry-run, no warnings); the
//! Argo CD and Flux objects point at overlays that exist.

use shardplane_testkit::{control_plane, repo_root};

fn render(overlay: &str) -> String {
    let dir = repo_root().join("manifests/tiers/overlays").join(overlay);
    let out = std::process::Command::new("kubectl")
        .arg("kustomize")
        .arg(&dir)
        .output()
        .expect("kubectl on PATH");
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn each_overlay_renders_and_the_server_accepts_it() {
    for (overlay, deployments, daily_replicas) in [("home-lab", 2, 1), ("studio-rack", 2, 3)] {
        let yaml = render(overlay);
        assert_eq!(
            yaml.matches("kind: ModelDeployment").count(),
            deployments,
            "{yaml}"
        );
        assert!(
            yaml.contains(&format!("replicas: {daily_replicas}")),
            "{yaml}"
        );
        // Cluster-scoped kinds carry no namespace; namespaced ones carry the site's.
        for doc in yaml.split("\n---\n") {
            let cluster_scoped =
                doc.contains("kind: NodePool") || doc.contains("kind: ShardingStrategy");
            let namespaced = doc.contains("kind: Model\n") || doc.contains("kind: ModelDeployment");
            if cluster_scoped {
                assert!(!doc.contains("namespace:"), "{overlay}: {doc}");
            }
            if namespaced {
                assert!(
                    doc.contains(&format!("namespace: {overlay}")),
                    "{overlay}: {doc}"
                );
            }
        }
        // The namespace must exist for a dry run of what goes into it.
        let ns = format!("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {overlay}\n");
        control_plane()
            .kubectl_stdin(&["apply", "-f", "-"], &ns)
            .unwrap();
        let applied = control_plane()
            .kubectl_output(&["apply", "--dry-run=server", "-f", "-"], &yaml)
            .unwrap();
        assert!(
            applied.success && applied.stderr.trim().is_empty(),
            "{overlay}:\n{}\n{}",
            applied.stdout,
            applied.stderr
        );
        assert_eq!(
            applied.stdout.matches("(server dry run)").count(),
            yaml.matches("\nkind: ").count() + usize::from(yaml.starts_with("kind: ")),
            "{}",
            applied.stdout
        );
    }
}

#[test]
fn gitops_objects_point_at_existing_overlays() {
    let gitops = repo_root().join("manifests/tiers/gitops");
    let mut paths = Vec::new();
    for file in ["argocd-home-lab.yaml", "flux-studio-rack.yaml"] {
        let text = std::fs::read_to_string(gitops.join(file)).unwrap();
        for line in text.lines() {
            if let Some(p) = line.trim().strip_prefix("path:") {
                paths.push(p.trim().trim_start_matches("./").to_string());
            }
        }
    }
    assert_eq!(
        paths,
        [
            "manifests/tiers/overlays/home-lab",
            "manifests/tiers/overlays/studio-rack"
        ]
    );
    for p in paths {
        assert!(
            repo_root().join(&p).join("kustomization.yaml").is_file(),
            "{p}"
        );
    }
}
