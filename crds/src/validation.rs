//! Rules the OpenAPI schema cannot express, checked by the operator (and by
//! anyone else holding an object). Old API servers ignore CEL rules, so every
//! CEL rule in the CRDs is repeated here.
//!
//! Each failure names the field's path and says what to change.

use std::collections::HashSet;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use crate::limits::*;
use crate::quantity;
use crate::v1alpha1::*;

/// One field that breaks a rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// Path of the field, e.g. `spec.layers`.
    pub path: String,
    /// What is wrong and what to do about it.
    pub message: String,
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Every rule an object breaks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ValidationErrors(pub Vec<FieldError>);

impl std::fmt::Display for ValidationErrors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        f.write_str(&parts.join("; "))
    }
}

impl ValidationErrors {
    /// Whether any rule failed on `path` or below it.
    pub fn has_path(&self, path: &str) -> bool {
        self.0.iter().any(|e| e.path.starts_with(path))
    }
}

/// Collects field errors while an object is checked.
#[derive(Default)]
struct Collector(Vec<FieldError>);

impl Collector {
    fn check(&mut self, ok: bool, path: &str, message: impl FnOnce() -> String) {
        if !ok {
            self.0.push(FieldError {
                path: path.to_string(),
                message: message(),
            });
        }
    }

    /// An optional quantity, when set, must be a byte count.
    fn byte_quantity(&mut self, q: Option<&Quantity>, path: &str) {
        if let Some(Err(e)) = q.map(quantity::parse_bytes) {
            self.check(false, path, || e.to_string());
        }
    }

    /// A count must not pass its bound (`limits`).
    fn at_most<T: PartialOrd + std::fmt::Display>(&mut self, value: T, max: T, path: &str) {
        if value > max {
            self.check(false, path, || {
                format!("{value} is more than the {max} allowed")
            });
        }
    }

    fn finish(self) -> Result<(), ValidationErrors> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(ValidationErrors(self.0))
        }
    }
}

/// Cross-field rules of one object.
pub trait Validate {
    /// Checks the object, returning every rule it breaks.
    fn validate(&self) -> Result<(), ValidationErrors>;
}

fn is_sha256(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn check_source(c: &mut Collector, source: &ModelSource, format: ModelFormat, path: &str) {
    match source {
        ModelSource::HuggingFace(hf) => {
            let p = format!("{path}.huggingFace");
            let mut parts = hf.repo.split('/');
            let well_formed = matches!((parts.next(), parts.next(), parts.next()), (Some(a), Some(b), None) if !a.is_empty() && !b.is_empty());
            c.check(well_formed, &format!("{p}.repo"), || {
                format!("{:?} is not a repository id: write owner/name", hf.repo)
            });
            match format {
                ModelFormat::Gguf => c.check(hf.file.is_some(), &format!("{p}.file"), || {
                    "a GGUF repository holds several files: name the one to serve (e.g. model.Q4_K_M.gguf)".into()
                }),
                ModelFormat::Safetensors => c.check(hf.file.is_none(), &format!("{p}.file"), || {
                    "a safetensors model is the whole repository: remove file".into()
                }),
            }
            if let Some(sum) = &hf.sha256 {
                c.check(is_sha256(sum), &format!("{p}.sha256"), || {
                    "must be 64 lowercase hex digits".into()
                });
            }
            if let Some(r) = &hf.token_secret_ref {
                c.check(
                    is_dns_subdomain(&r.name),
                    &format!("{p}.tokenSecretRef.name"),
                    || format!("{:?} is not a Secret's name", r.name),
                );
                c.check(
                    !r.key.is_empty(),
                    &format!("{p}.tokenSecretRef.key"),
                    || "name the Secret's key that holds the token".into(),
                );
            }
        }
        ModelSource::Url(u) => {
            let p = format!("{path}.url");
            c.check(
                u.url.starts_with("http://") || u.url.starts_with("https://"),
                &format!("{p}.url"),
                || format!("{:?} is not an http(s) URL", u.url),
            );
            c.check(format == ModelFormat::Gguf, &format!("{p}.url"), || {
                "a URL names one file, so it can only serve a GGUF model: use huggingFace or path for safetensors".into()
            });
            if let Some(sum) = &u.sha256 {
                c.check(is_sha256(sum), &format!("{p}.sha256"), || {
                    "must be 64 lowercase hex digits".into()
                });
            }
        }
        ModelSource::Path(pth) => {
            let p = format!("{path}.path");
            c.check(pth.path.starts_with('/'), &format!("{p}.path"), || {
                format!("{:?} is not an absolute path", pth.path)
            });
            if let Some(sum) = &pth.sha256 {
                c.check(is_sha256(sum), &format!("{p}.sha256"), || {
                    "must be 64 lowercase hex digits".into()
                });
            }
        }
    }
}

impl Validate for Model {
    fn validate(&self) -> Result<(), ValidationErrors> {
        let mut c = Collector::default();
        check_source(&mut c, &self.spec.source, self.spec.format, "spec.source");
        if let Some(name) = &self.spec.served_name {
            c.check(!name.trim().is_empty(), "spec.servedName", || {
                "must not be blank".into()
            });
        }
        if let Some(n) = self.spec.max_context_length {
            c.check(n > 0, "spec.maxContextLength", || {
                "must be at least 1".into()
            });
            c.at_most(n, MAX_CONTEXT_LENGTH, "spec.maxContextLength");
        }
        if let Some(t) = &self.spec.chat_template {
            c.check(!t.trim().is_empty(), "spec.chatTemplate", || {
                "must not be blank (leave it out to use the weights' template)".into()
            });
        }
        c.finish()
    }
}

fn check_selector(c: &mut Collector, sel: &LabelSelector, path: &str) {
    for (i, expr) in sel.match_expressions.iter().flatten().enumerate() {
        let p = format!("{path}.matchExpressions[{i}]");
        let values = expr.values.as_deref().unwrap_or_default();
        match expr.operator.as_str() {
            "In" | "NotIn" => c.check(!values.is_empty(), &format!("{p}.values"), || {
                format!("operator {} needs at least one value", expr.operator)
            }),
            "Exists" | "DoesNotExist" => c.check(values.is_empty(), &format!("{p}.values"), || {
                format!("operator {} takes no values", expr.operator)
            }),
            other => c.check(false, &format!("{p}.operator"), || {
                format!("unknown operator {other:?}: use In, NotIn, Exists or DoesNotExist")
            }),
        }
    }
}

impl Validate for NodePool {
    fn validate(&self) -> Result<(), ValidationErrors> {
        let mut c = Collector::default();
        check_selector(&mut c, &self.spec.node_selector, "spec.nodeSelector");
        c.byte_quantity(self.spec.memory_reserve.as_ref(), "spec.memoryReserve");
        c.finish()
    }
}

impl Validate for ShardingStrategy {
    fn validate(&self) -> Result<(), ValidationErrors> {
        let s = &self.spec;
        let mut c = Collector::default();
        c.at_most(
            s.min_nodes.unwrap_or(1),
            MAX_NODES_PER_INSTANCE,
            "spec.minNodes",
        );
        c.at_most(
            s.max_nodes.unwrap_or(1),
            MAX_NODES_PER_INSTANCE,
            "spec.maxNodes",
        );
        if let (Some(min), Some(max)) = (s.min_nodes, s.max_nodes) {
            c.check(min <= max, "spec.minNodes", || {
                format!("minNodes ({min}) is above maxNodes ({max})")
            });
        }
        match s.parallelism {
            Parallelism::None => {
                c.check(s.min_nodes.unwrap_or(1) == 1, "spec.minNodes", || {
                    "parallelism none puts the whole model on one node: minNodes must be 1 or unset"
                        .into()
                });
                c.check(s.max_nodes.unwrap_or(1) == 1, "spec.maxNodes", || {
                    "parallelism none puts the whole model on one node: maxNodes must be 1 or unset"
                        .into()
                });
            }
            Parallelism::Pipeline => {}
            Parallelism::Tensor => {
                c.check(s.max_nodes.unwrap_or(2) >= 2, "spec.maxNodes", || {
                    "tensor parallelism needs at least 2 nodes".into()
                });
                if let Some(size) = s.tensor_size {
                    c.check(size >= 2, "spec.tensorSize", || {
                        "a tensor group has at least 2 ranks".into()
                    });
                    c.at_most(size, MAX_TENSOR_RANKS, "spec.tensorSize");
                    c.check(
                        s.max_nodes.is_none_or(|m| m >= size),
                        "spec.maxNodes",
                        || format!("maxNodes is below tensorSize ({size}): not one group fits"),
                    );
                }
            }
        }
        c.check(
            s.tensor_size.is_none() || s.parallelism == Parallelism::Tensor,
            "spec.tensorSize",
            || {
                format!(
                    "tensorSize is for parallelism tensor, not {}",
                    s.parallelism
                )
            },
        );
        c.check(
            s.kv_cache.context_length > 0,
            "spec.kvCache.contextLength",
            || "must be at least 1".into(),
        );
        c.check(
            s.kv_cache.concurrent_sequences > 0,
            "spec.kvCache.concurrentSequences",
            || "must be at least 1".into(),
        );
        c.at_most(
            s.kv_cache.context_length,
            MAX_CONTEXT_LENGTH,
            "spec.kvCache.contextLength",
        );
        c.at_most(
            s.kv_cache.concurrent_sequences,
            MAX_CONCURRENT_SEQUENCES,
            "spec.kvCache.concurrentSequences",
        );
        c.byte_quantity(s.stage_overhead.as_ref(), "spec.stageOverhead");
        c.finish()
    }
}

/// Whether `s` is a DNS subdomain (RFC 1123), as most object names must be.
pub fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            !label.is_empty()
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

impl Validate for ModelDeployment {
    fn validate(&self) -> Result<(), ValidationErrors> {
        let s = &self.spec;
        let mut c = Collector::default();
        for (path, name) in [
            ("spec.model", &s.model),
            ("spec.nodePool", &s.node_pool),
            ("spec.strategy", &s.strategy),
        ] {
            c.check(is_dns_subdomain(name), path, || {
                format!("{name:?} is not an object name (lowercase letters, digits, '-' and '.')")
            });
        }
        c.check(s.replicas >= 0, "spec.replicas", || {
            format!("{} replicas: must be 0 or more", s.replicas)
        });
        c.at_most(s.replicas, MAX_REPLICAS, "spec.replicas");
        c.at_most(s.aliases.len(), MAX_ALIASES, "spec.aliases");
        c.at_most(s.fallback.len(), MAX_FALLBACK, "spec.fallback");
        let mut seen = HashSet::new();
        for (i, alias) in s.aliases.iter().enumerate() {
            c.check(
                !alias.trim().is_empty(),
                &format!("spec.aliases[{i}]"),
                || "must not be blank".into(),
            );
            c.check(seen.insert(alias), &format!("spec.aliases[{i}]"), || {
                format!("{alias:?} is listed twice")
            });
        }
        let own = self.metadata.name.as_deref().unwrap_or_default();
        for (i, target) in s.fallback.iter().enumerate() {
            let p = format!("spec.fallback[{i}]");
            match target {
                FallbackTarget::Deployment(name) => {
                    c.check(name != own, &format!("{p}.deployment"), || {
                        "a deployment cannot fall back to itself".into()
                    });
                    c.check(is_dns_subdomain(name), &format!("{p}.deployment"), || {
                        format!("{name:?} is not an object name")
                    });
                }
                FallbackTarget::External(ext) => {
                    c.check(
                        ext.base_url.starts_with("http://") || ext.base_url.starts_with("https://"),
                        &format!("{p}.external.baseUrl"),
                        || format!("{:?} is not an http(s) URL", ext.base_url),
                    );
                }
            }
        }
        c.finish()
    }
}

impl ModelDeployment {
    /// Rules between the deployment and the pool and strategy it names: the
    /// daily tier holds whole models, the reasoning tier shards them.
    pub fn validate_binding(
        &self,
        pool: &NodePool,
        strategy: &ShardingStrategy,
    ) -> Result<(), ValidationErrors> {
        let mut c = Collector::default();
        let parallelism = strategy.spec.parallelism;
        match pool.spec.tier {
            Tier::Daily => c.check(parallelism == Parallelism::None, "spec.strategy", || {
                format!(
                    "node pool {:?} is a daily pool, which holds whole models, but strategy {:?} has parallelism {parallelism}: use a strategy with parallelism none",
                    pool.metadata.name.as_deref().unwrap_or_default(),
                    strategy.metadata.name.as_deref().unwrap_or_default()
                )
            }),
            Tier::Reasoning => c.check(parallelism != Parallelism::None, "spec.strategy", || {
                format!(
                    "node pool {:?} is a reasoning pool, which shards models across nodes, but strategy {:?} has parallelism none: use a pipeline or tensor strategy, or a daily pool",
                    pool.metadata.name.as_deref().unwrap_or_default(),
                    strategy.metadata.name.as_deref().unwrap_or_default()
                )
            }),
        }
        c.finish()
    }
}

impl Validate for Shard {
    fn validate(&self) -> Result<(), ValidationErrors> {
        let s = &self.spec;
        let mut c = Collector::default();
        check_source(&mut c, &s.source, s.format, "spec.source");
        let LayerRange { start, end } = s.layers;
        c.check(start < end, "spec.layers", || {
            format!("layer range {start}-{end} is empty or reversed: start must be below end")
        });
        c.check(end <= s.total_layers, "spec.layers.end", || {
            format!("layer {end} is past the model's {} layers", s.total_layers)
        });
        c.check(s.stage < s.stage_count, "spec.stage", || {
            format!(
                "stage {} of {} stages: must be below stageCount",
                s.stage, s.stage_count
            )
        });
        let first = s.stage == 0;
        let last = s.stage + 1 == s.stage_count;
        c.check(!first || start == 0, "spec.layers.start", || {
            format!("the first stage must start at layer 0, not {start}")
        });
        c.check(!last || end == s.total_layers, "spec.layers.end", || {
            format!(
                "the last stage must end at layer {}, not {end}",
                s.total_layers
            )
        });
        c.check(first == s.previous.is_none(), "spec.previous", || {
            if first {
                "the first stage has no previous stage".into()
            } else {
                "every stage but the first names its previous stage".into()
            }
        });
        c.check(last == s.next.is_none(), "spec.next", || {
            if last {
                "the last stage has no next stage".into()
            } else {
                "every stage but the last names its next stage".into()
            }
        });
        c.check(is_dns_subdomain(&s.node), "spec.node", || {
            format!("{:?} is not a node name", s.node)
        });
        if let Some(t) = &s.tensor {
            let ranks = t.weights.len();
            c.check(
                (2..=MAX_TENSOR_RANKS as usize).contains(&ranks),
                "spec.tensor.weights",
                || format!("a tensor group has 2 to {MAX_TENSOR_RANKS} ranks, not {ranks}"),
            );
            c.check(t.group.len() == ranks, "spec.tensor.group", || {
                format!("{} Shards for {ranks} ranks", t.group.len())
            });
            c.check((t.rank as usize) < ranks, "spec.tensor.rank", || {
                format!("rank {} of {ranks} ranks", t.rank)
            });
            c.check(
                t.weights.iter().all(|&w| w > 0),
                "spec.tensor.weights",
                || "every rank's weight is at least 1".into(),
            );
            c.check(
                t.group.iter().all(|n| is_dns_subdomain(n)),
                "spec.tensor.group",
                || "every rank's Shard has a valid name".into(),
            );
            if let Some(me) = &self.metadata.name {
                c.check(
                    t.group.get(t.rank as usize) == Some(me),
                    "spec.tensor.group",
                    || format!("rank {} names another Shard than {me}", t.rank),
                );
            }
        }
        c.finish()
    }
}

impl Validate for InferenceNode {
    fn validate(&self) -> Result<(), ValidationErrors> {
        let mut c = Collector::default();
        let Some(status) = &self.status else {
            return Ok(());
        };
        if let Some(mem) = &status.memory {
            let parsed = [
                ("status.memory.total", &mem.total),
                ("status.memory.allocatable", &mem.allocatable),
                ("status.memory.available", &mem.available),
            ]
            .map(|(path, q)| {
                quantity::parse_bytes(q)
                    .map_err(|e| c.check(false, path, || e.to_string()))
                    .ok()
            });
            if let [Some(total), Some(allocatable), _] = parsed {
                c.check(allocatable <= total, "status.memory.allocatable", || {
                    "allocatable memory exceeds total memory".into()
                });
            }
        }
        let own = self.metadata.name.as_deref().unwrap_or_default();
        for (i, link) in status.links.iter().enumerate() {
            c.check(link.node != own, &format!("status.links[{i}].node"), || {
                "a node has no link to itself".into()
            });
        }
        c.finish()
    }
}
