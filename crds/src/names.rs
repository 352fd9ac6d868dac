//! Who serves a name. Clients ask for a model by a name: a Model's served
//! name or a deployment's alias. Deployments in any namespace may claim the
//! same one, so one rule, shared by the operator and the gateway, settles it:
//! a name belongs to the namespace of the oldest deployment claiming it
//! (creation time, then namespace and name). In that namespace several
//! deployments may share it (the oldest is asked first); a deployment of
//! another namespace that claims it is refused (`NameConflict`) and never
//! served under it, so nobody can take over a name by creating a deployment.
//!
//! ```text
//!  claims of every deployment ──► oldest claimant per name ──► its namespace owns the name
//! ```

use crate::ModelDeployment;

/// The order of claims: creation time (unset last), then namespace and name.
pub type Age = (bool, Option<k8s_openapi::jiff::Timestamp>, String, String);

/// Where `d` stands among the claimants of a name: the least is the oldest.
pub fn age(d: &ModelDeployment) -> Age {
    let created = d.metadata.creation_timestamp.as_ref().map(|t| t.0);
    (
        created.is_none(),
        created,
        d.metadata.namespace.clone().unwrap_or_default(),
        d.metadata.name.clone().unwrap_or_default(),
    )
}

/// The names `d` claims: its Model's served name (when known), then its
/// aliases.
pub fn claims(d: &ModelDeployment, served_name: Option<&str>) -> Vec<String> {
    served_name
        .map(str::to_string)
        .into_iter()
        .chain(d.spec.aliases.iter().cloned())
        .collect()
}

/// For each name `d` claims (`mine`) that another namespace owns: the name
/// and the deployment (`namespace/name`) owning it. `all` is every
/// deployment with the names it claims (`d` among them or not).
pub fn conflicts(
    d: &ModelDeployment,
    mine: &[String],
    all: &[(&ModelDeployment, Vec<String>)],
) -> Vec<(String, String)> {
    let key = |o: &ModelDeployment| {
        (
            o.metadata.namespace.clone().unwrap_or_default(),
            o.metadata.name.clone().unwrap_or_default(),
        )
    };
    let my_ns = key(d).0;
    let mut out: Vec<(String, String)> = mine
        .iter()
        .filter_map(|name| {
            let owner = all
                .iter()
                .filter(|(_, names)| names.contains(name))
                .map(|(o, _)| *o)
                .chain(std::iter::once(d))
                .min_by_key(|o| age(o))?;
            let (ns, owner) = key(owner);
            (ns != my_ns).then(|| (name.clone(), format!("{ns}/{owner}")))
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn deployment(ns: &str, name: &str, created: i64, aliases: &[&str]) -> ModelDeployment {
        let mut d = ModelDeployment::new(
            name,
            serde_json::from_value(serde_json::json!({
                "model": "m", "nodePool": "p", "strategy": "s"
            }))
            .unwrap(),
        );
        d.metadata.namespace = Some(ns.into());
        d.metadata.creation_timestamp = Some(Time(
            k8s_openapi::jiff::Timestamp::from_second(created).unwrap(),
        ));
        d.spec.aliases = aliases.iter().map(|a| a.to_string()).collect();
        d
    }

    #[test]
    fn a_name_belongs_to_the_namespace_that_claimed_it_first() {
        let prod = deployment("prod", "llm", 100, &["coder"]);
        let prod_b = deployment("prod", "llm-b", 300, &["coder"]);
        // Alphabetically first, created later: it must not take the name.
        let intruder = deployment("aaa", "x", 200, &["coder", "free"]);
        let all: Vec<_> = [&prod, &prod_b, &intruder]
            .map(|d| (d, claims(d, Some("smol"))))
            .into();
        let mine = claims(&intruder, Some("smol"));
        assert_eq!(
            conflicts(&intruder, &mine, &all),
            [
                ("coder".to_string(), "prod/llm".to_string()),
                ("smol".to_string(), "prod/llm".to_string())
            ]
        );
        // Sharing inside the owning namespace is fine.
        assert!(conflicts(&prod_b, &claims(&prod_b, Some("smol")), &all).is_empty());
        assert!(conflicts(&prod, &claims(&prod, Some("smol")), &all).is_empty());
        // Equal times: namespace, then name, decide.
        let twin = deployment("zzz", "y", 100, &["coder"]);
        assert_eq!(
            conflicts(&twin, &claims(&twin, None), &[(&prod, claims(&prod, None))]),
            [("coder".to_string(), "prod/llm".to_string())]
        );
        assert!(age(&prod) < age(&twin));
    }
}
