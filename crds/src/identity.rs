//! Node identities. Every agent may run under a ServiceAccount of its own,
//! named after its InferenceNode (`shardplane-node-<node>`, minted by
//! `shardplane agent-kubeconfig --node`). The operator's admission webhook
//! reads the node from the request's user and lets it write only that
//! node's objects (the idea of Kubernetes' NodeRestriction).
//!
//! ```text
//!  system:serviceaccount:<ns>:shardplane-node-<node> ──► node_of_user ──► Some(<node>)
//!  any other user                                    ──► None (RBAC alone decides)
//! ```

/// The prefix of a node identity's ServiceAccount name.
pub const NODE_IDENTITY_PREFIX: &str = "shardplane-node-";

/// The signer (`spec.signerName` of a CertificateSigningRequest) whose
/// certificates the data plane trusts: the operator approves and signs a
/// node identity's request for a certificate naming its own node, and a
/// gateway's for a client certificate naming none.
pub const DATA_PLANE_SIGNER: &str = "shardplane.dev/data-plane";

/// The common name of a gateway's data-plane certificate (it has no DNS
/// name: it names no node).
pub const GATEWAY_COMMON_NAME: &str = "shardplane-gateway";

/// The label on the node-lease namespace that sends its Leases through the
/// admission webhook (agents cannot label namespaces).
pub const NODE_LEASES_LABEL: &str = "shardplane.dev/node-leases";

/// The ServiceAccount name of `node`'s identity, when it is a valid name
/// (a DNS subdomain of at most 253 characters).
pub fn node_service_account(node: &str) -> Option<String> {
    let name = format!("{NODE_IDENTITY_PREFIX}{node}");
    (name.len() <= 253 && crate::validation::is_dns_subdomain(node)).then_some(name)
}

/// The node whose identity `username` is, if it is one: any ServiceAccount
/// named `shardplane-node-<node>`, in any namespace. Such a name only ever
/// narrows what its holder may do, so where it lives does not matter.
pub fn node_of_user(username: &str) -> Option<&str> {
    let rest = username.strip_prefix("system:serviceaccount:")?;
    let (_namespace, account) = rest.split_once(':')?;
    account
        .strip_prefix(NODE_IDENTITY_PREFIX)
        .filter(|node| !node.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_identity_names_its_node() {
        assert_eq!(
            node_of_user("system:serviceaccount:shardplane:shardplane-node-studio-1"),
            Some("studio-1")
        );
        assert_eq!(
            node_of_user("system:serviceaccount:other:shardplane-node-a.b"),
            Some("a.b")
        );
        for user in [
            "system:serviceaccount:shardplane:shardplane-agent",
            "system:serviceaccount:shardplane:shardplane-node-",
            "shardplane-node-x",
            "admin",
            "system:serviceaccount:shardplane-node-x",
        ] {
            assert_eq!(node_of_user(user), None, "{user}");
        }
        assert_eq!(
            node_service_account("studio-1").as_deref(),
            Some("shardplane-node-studio-1")
        );
        assert_eq!(node_service_account("Not_A_Name"), None);
        assert_eq!(node_service_account(&"a".repeat(250)), None);
    }
}
