//! Credentials kept in Secrets that an object names (a Model's hub token, an
//! external endpoint's API key), read by name only, and only from Secrets
//! that opt in with a label: naming a Secret in a spec must not be a way to
//! read any Secret the component can get.
//!
//! ```text
//!  spec ──► {name, key} ──► GET secrets/<name> in the object's namespace
//!                             │ labelled <label>: "true"?  else NotOptedIn
//!                             └► data[key] as trimmed text   else KeyMissing
//! ```

use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client, ResourceExt};

/// Why a named Secret's value cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The API server did not give the Secret (absent, or not allowed).
    #[error("cannot read Secret {namespace}/{name}: {source}")]
    Unreadable {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
        /// The API's answer.
        source: kube::Error,
    },
    /// The Secret does not carry the opt-in label.
    #[error(
        "Secret {namespace}/{name} is not labelled {label}=true: only Secrets that opt in are used"
    )]
    NotOptedIn {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
        /// The label it lacks.
        label: &'static str,
    },
    /// The Secret lacks the key, or holds no text there.
    #[error("Secret {namespace}/{name} has no text under key {key}")]
    KeyMissing {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
        /// The key.
        key: String,
    },
}

impl SecretError {
    /// A condition's reason for it.
    pub fn reason(&self) -> &'static str {
        match self {
            SecretError::Unreadable { .. } => "SecretUnreadable",
            SecretError::NotOptedIn { .. } => "SecretNotOptedIn",
            SecretError::KeyMissing { .. } => "SecretKeyMissing",
        }
    }
}

/// Gets the Secret `name` in `namespace`, whatever its labels.
pub async fn get(client: &Client, namespace: &str, name: &str) -> Result<Secret, SecretError> {
    Api::<Secret>::namespaced(client.clone(), namespace)
        .get(name)
        .await
        .map_err(|source| SecretError::Unreadable {
            namespace: namespace.to_string(),
            name: name.to_string(),
            source,
        })
}

/// The text under `key` of the Secret `name` in `namespace` (whitespace
/// around it dropped), when the Secret carries `label: "true"`.
pub async fn read_opted_in(
    client: &Client,
    namespace: &str,
    name: &str,
    key: &str,
    label: &'static str,
) -> Result<String, SecretError> {
    let secret = get(client, namespace, name).await?;
    value_of(secret, namespace, name, key, label)
}

/// The check and the value, apart from the request.
fn value_of(
    secret: Secret,
    namespace: &str,
    name: &str,
    key: &str,
    label: &'static str,
) -> Result<String, SecretError> {
    if secret.labels().get(label).map(String::as_str) != Some("true") {
        return Err(SecretError::NotOptedIn {
            namespace: namespace.to_string(),
            name: name.to_string(),
            label,
        });
    }
    secret
        .data
        .and_then(|d| d.get(key).cloned())
        .and_then(|v| String::from_utf8(v.0).ok())
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .ok_or_else(|| SecretError::KeyMissing {
            namespace: namespace.to_string(),
            name: name.to_string(),
            key: key.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;

    fn secret(labelled: bool, data: &[(&str, &[u8])]) -> Secret {
        let mut s = Secret::default();
        if labelled {
            s.metadata.labels = Some([("l".to_string(), "true".to_string())].into());
        }
        s.data = Some(
            data.iter()
                .map(|(k, v)| (k.to_string(), ByteString(v.to_vec())))
                .collect(),
        );
        s
    }

    #[test]
    fn only_an_opted_in_secrets_text_is_given() {
        let v = value_of(
            secret(true, &[("token", b" hf_x\n")]),
            "ns",
            "s",
            "token",
            "l",
        );
        assert_eq!(v.unwrap(), "hf_x");
        let e = value_of(
            secret(false, &[("token", b"hf_x")]),
            "ns",
            "s",
            "token",
            "l",
        );
        assert_eq!(e.unwrap_err().reason(), "SecretNotOptedIn");
        for (data, k) in [
            (&[("token", b"hf_x" as &[u8])][..], "other"),
            (&[("token", b"  \n" as &[u8])][..], "token"),
            (&[("token", b"\xff\xfe" as &[u8])][..], "token"),
        ] {
            let e = value_of(secret(true, data), "ns", "s", k, "l").unwrap_err();
            assert_eq!(e.reason(), "SecretKeyMissing", "{e}");
            assert!(e.to_string().contains(&format!("key {k}")), "{e}");
        }
    }
}
