//! The cross-field rules `validate()` enforces (old API servers ignore CEL), one
//! table per kind: each broken object names the field and says what to change.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;
use shardplane_crds::validation::{Validate, ValidationErrors};
use shardplane_crds::*;
use shardplane_testkit::fixtures;

fn range(start: u32, end: u32) -> LayerRange {
    LayerRange { start, end }
}

#[track_caller]
fn assert_rejects<T: Validate>(object: &T, path: &str, words: &str) {
    let errors: ValidationErrors = object.validate().expect_err("the object should be invalid");
    assert!(
        errors.has_path(path),
        "expected an error at {path}, got: {errors}"
    );
    assert!(
        errors.to_string().contains(words),
        "expected {words:?} in: {errors}"
    );
}

#[test]
fn fixtures_are_valid() {
    fixtures::model("m").validate().unwrap();
    fixtures::node_pool("p", Tier::Daily).validate().unwrap();
    fixtures::strategy("s", Parallelism::Pipeline)
        .validate()
        .unwrap();
    fixtures::deployment("d", "m", "p", "s").validate().unwrap();
    for stage in 0..3 {
        fixtures::shard("d", "n", stage, 3, range(stage * 10, stage * 10 + 10))
            .validate()
            .unwrap();
    }
    fixtures::inference_node("n").validate().unwrap();
}

#[test]
fn shard_layer_range_must_be_ordered_and_inside_the_model() {
    let reversed = fixtures::shard("d", "n", 1, 3, range(20, 10));
    assert_rejects(&reversed, "spec.layers", "reversed");
    let empty = fixtures::shard("d", "n", 1, 3, range(10, 10));
    assert_rejects(&empty, "spec.layers", "start must be below end");
    let past_end = fixtures::shard("d", "n", 2, 3, range(20, 31));
    assert_rejects(&past_end, "spec.layers.end", "past the model's 30 layers");
}

#[test]
fn shard_stages_must_chain() {
    let mut first = fixtures::shard("d", "n", 0, 2, range(3, 15));
    assert_rejects(
        &first,
        "spec.layers.start",
        "first stage must start at layer 0",
    );
    first.spec.layers = range(0, 15);
    first.spec.next = None;
    assert_rejects(&first, "spec.next", "every stage but the last");
    let mut last = fixtures::shard("d", "n", 1, 2, range(15, 29));
    assert_rejects(&last, "spec.layers.end", "last stage must end at layer 30");
    last.spec.layers = range(15, 30);
    last.spec.previous = None;
    assert_rejects(&last, "spec.previous", "every stage but the first");
    let beyond = fixtures::shard("d", "n", 3, 3, range(0, 30));
    assert_rejects(&beyond, "spec.stage", "must be below stageCount");
    let mut bad_node = fixtures::shard("d", "n", 0, 1, range(0, 30));
    bad_node.spec.node = "Not_A_Node".into();
    assert_rejects(&bad_node, "spec.node", "not a node name");
}

#[test]
fn model_source_must_fit_the_format() {
    let mut m = fixtures::model("m");
    m.spec.source = ModelSource::HuggingFace(HuggingFaceSource {
        repo: "owner/repo".into(),
        file: None,
        revision: None,
        sha256: None,
        token_secret_ref: None,
    });
    assert_rejects(&m, "spec.source.huggingFace.file", "name the one to serve");
    m.spec.format = ModelFormat::Safetensors;
    m.validate().unwrap();
    if let ModelSource::HuggingFace(hf) = &mut m.spec.source {
        hf.sha256 = Some("ABC".into());
    }
    assert_rejects(
        &m,
        "spec.source.huggingFace.sha256",
        "64 lowercase hex digits",
    );
    if let ModelSource::HuggingFace(hf) = &mut m.spec.source {
        hf.sha256 = None;
        hf.token_secret_ref = Some(SecretKeyRef {
            name: "Hub_Token".into(),
            key: String::new(),
        });
    }
    assert_rejects(
        &m,
        "spec.source.huggingFace.tokenSecretRef.name",
        "not a Secret's name",
    );
    assert_rejects(
        &m,
        "spec.source.huggingFace.tokenSecretRef.key",
        "the Secret's key that holds the token",
    );
    if let ModelSource::HuggingFace(hf) = &mut m.spec.source {
        hf.sha256 = None;
    }
    m.spec.source = ModelSource::Url(UrlSource {
        url: "https://example.invalid/model".into(),
        sha256: None,
    });
    assert_rejects(&m, "spec.source.url.url", "only serve a GGUF model");
    m.spec.format = ModelFormat::Gguf;
    m.spec.source = ModelSource::Url(UrlSource {
        url: "https://example.invalid/m.gguf".into(),
        sha256: Some("ABC".into()),
    });
    assert_rejects(&m, "spec.source.url.sha256", "64 lowercase hex digits");
    m.spec.source = ModelSource::Path(PathSource {
        path: "relative/m.gguf".into(),
        sha256: None,
    });
    assert_rejects(&m, "spec.source.path.path", "not an absolute path");
}

#[test]
fn strategy_node_bounds_fit_the_parallelism() {
    let mut s = fixtures::strategy("s", Parallelism::Pipeline);
    s.spec.min_nodes = Some(4);
    s.spec.max_nodes = Some(2);
    assert_rejects(&s, "spec.minNodes", "minNodes (4) is above maxNodes (2)");
    let mut whole = fixtures::strategy("s", Parallelism::None);
    whole.spec.max_nodes = Some(3);
    assert_rejects(
        &whole,
        "spec.maxNodes",
        "parallelism none puts the whole model on one node",
    );
    let mut tensor = fixtures::strategy("s", Parallelism::Tensor);
    tensor.spec.max_nodes = Some(1);
    assert_rejects(&tensor, "spec.maxNodes", "at least 2 nodes");
    tensor.spec.max_nodes = Some(3);
    tensor.spec.tensor_size = Some(4);
    assert_rejects(&tensor, "spec.maxNodes", "below tensorSize (4)");
    let mut sized_pipeline = fixtures::strategy("s", Parallelism::Pipeline);
    sized_pipeline.spec.tensor_size = Some(2);
    assert_rejects(
        &sized_pipeline,
        "spec.tensorSize",
        "tensorSize is for parallelism tensor, not pipeline",
    );
    let mut overhead = fixtures::strategy("s", Parallelism::Pipeline);
    overhead.spec.stage_overhead = Some(Quantity("lots".into()));
    assert_rejects(&overhead, "spec.stageOverhead", "not a byte quantity");
}

#[test]
fn node_pool_selector_and_reserve_are_well_formed() {
    let mut p = fixtures::node_pool("p", Tier::Reasoning);
    p.spec.node_selector.match_expressions = Some(vec![LabelSelectorRequirement {
        key: "chip".into(),
        operator: "Like".into(),
        values: None,
    }]);
    assert_rejects(
        &p,
        "spec.nodeSelector.matchExpressions[0].operator",
        "unknown operator",
    );
    p.spec.node_selector.match_expressions = Some(vec![LabelSelectorRequirement {
        key: "chip".into(),
        operator: "In".into(),
        values: None,
    }]);
    assert_rejects(
        &p,
        "spec.nodeSelector.matchExpressions[0].values",
        "at least one value",
    );
    let mut r = fixtures::node_pool("p", Tier::Daily);
    r.spec.memory_reserve = Some(Quantity("-4Gi".into()));
    assert_rejects(&r, "spec.memoryReserve", "negative");
}

#[test]
fn deployment_names_aliases_and_fallbacks() {
    let mut d = fixtures::deployment("d", "m", "p", "s");
    d.spec.replicas = -1;
    assert_rejects(&d, "spec.replicas", "must be 0 or more");
    let mut d = fixtures::deployment("d", "Model_X", "p", "s");
    d.spec.aliases = vec!["a".into(), "a".into()];
    d.spec.fallback = vec![FallbackTarget::Deployment("d".into())];
    let errors = d.validate().unwrap_err();
    assert!(errors.has_path("spec.model"), "{errors}");
    assert!(errors.has_path("spec.aliases[1]"), "{errors}");
    assert!(errors.has_path("spec.fallback[0].deployment"), "{errors}");
    assert_eq!(
        errors.0.len(),
        3,
        "every broken rule is reported at once: {errors}"
    );
}

#[test]
fn counts_are_bounded_as_the_schema_bounds_them() {
    // Objects stored before a bound existed still meet it in the controllers.
    let mut d = fixtures::deployment("d", "m", "p", "s");
    d.spec.replicas = i32::MAX;
    d.spec.aliases = (0..=limits::MAX_ALIASES).map(|i| format!("a{i}")).collect();
    d.spec.fallback = (0..=limits::MAX_FALLBACK)
        .map(|i| FallbackTarget::Deployment(format!("f{i}")))
        .collect();
    let errors = d.validate().unwrap_err();
    for path in ["spec.replicas", "spec.aliases", "spec.fallback"] {
        assert!(errors.has_path(path), "{path}: {errors}");
    }
    assert!(
        errors
            .to_string()
            .contains("2147483647 is more than the 1024 allowed"),
        "{errors}"
    );
    d.spec.replicas = limits::MAX_REPLICAS;
    d.spec.aliases.clear();
    d.spec.fallback.clear();
    d.validate().expect("the bound itself is allowed");

    let mut s = fixtures::strategy("s", Parallelism::Pipeline);
    s.spec.max_nodes = Some(u32::MAX);
    s.spec.kv_cache.context_length = u32::MAX;
    s.spec.kv_cache.concurrent_sequences = u32::MAX;
    let errors = s.validate().unwrap_err();
    for path in [
        "spec.maxNodes",
        "spec.kvCache.contextLength",
        "spec.kvCache.concurrentSequences",
    ] {
        assert!(errors.has_path(path), "{path}: {errors}");
    }
    let mut m = fixtures::model("m");
    m.spec.max_context_length = Some(u32::MAX);
    assert_rejects(
        &m,
        "spec.maxContextLength",
        "more than the 16777216 allowed",
    );
}

#[test]
fn tier_and_parallelism_must_agree() {
    let d = fixtures::deployment("d", "m", "p", "s");
    let daily = fixtures::node_pool("p", Tier::Daily);
    let reasoning = fixtures::node_pool("p", Tier::Reasoning);
    let whole = fixtures::strategy("s", Parallelism::None);
    let pipeline = fixtures::strategy("s", Parallelism::Pipeline);
    d.validate_binding(&daily, &whole).unwrap();
    d.validate_binding(&reasoning, &pipeline).unwrap();
    let e = d.validate_binding(&daily, &pipeline).unwrap_err();
    assert!(
        e.to_string()
            .contains("daily pool, which holds whole models"),
        "{e}"
    );
    let e = d.validate_binding(&reasoning, &whole).unwrap_err();
    assert!(
        e.to_string().contains("use a pipeline or tensor strategy"),
        "{e}"
    );
}

#[test]
fn node_memory_must_add_up() {
    let mut n = fixtures::inference_node("n");
    n.status = Some(InferenceNodeStatus {
        memory: Some(NodeMemory {
            total: Quantity("16Gi".into()),
            allocatable: Quantity("32Gi".into()),
            available: Quantity("8Gi".into()),
        }),
        ..Default::default()
    });
    assert_rejects(&n, "status.memory.allocatable", "exceeds total memory");
}

/// Rank `rank` of a group of two whole-model ranks (`d-0-0`, `d-0-0-r1`).
fn rank(rank: u32) -> Shard {
    let mut s = fixtures::shard("d", "n", 0, 1, range(0, 30));
    let group = vec!["d-0-0".to_string(), "d-0-0-r1".to_string()];
    s.metadata.name = Some(group[rank as usize].clone());
    s.spec.tensor = Some(TensorRankSpec {
        rank,
        weights: vec![2, 1],
        group,
    });
    s
}

#[test]
fn a_tensor_rank_names_its_group_consistently() {
    rank(0).validate().unwrap();
    rank(1).validate().unwrap();
    let mut out_of_range = rank(1);
    out_of_range.spec.tensor.as_mut().unwrap().rank = 2;
    assert_rejects(&out_of_range, "spec.tensor.rank", "rank 2 of 2 ranks");
    let mut short = rank(0);
    short.spec.tensor.as_mut().unwrap().group.pop();
    assert_rejects(&short, "spec.tensor.group", "1 Shards for 2 ranks");
    let mut zero = rank(0);
    zero.spec.tensor.as_mut().unwrap().weights[1] = 0;
    assert_rejects(&zero, "spec.tensor.weights", "at least 1");
    let mut alone = rank(0);
    let t = alone.spec.tensor.as_mut().unwrap();
    t.weights.truncate(1);
    t.group.truncate(1);
    assert_rejects(&alone, "spec.tensor.weights", "2 to 64 ranks, not 1");
    let mut other = rank(0);
    other.metadata.name = Some("someone-else".into());
    assert_rejects(&other, "spec.tensor.group", "rank 0 names another Shard");
}
