//! GGUF tokenizers tokenize as the families' own tokenizers do.
//!
//! - SentencePiece (`tokenizer.ggml.model = llama`: Llama 2, Mistral, Gemma):
//!   a small BPE model trained by `reference/tiny_tokenizer.py` with the
//!   `sentencepiece` package, written as GGUF metadata the way llama.cpp's
//!   converter writes it: with and without the space prefix, byte fallback
//!   for characters outside the vocabulary, and control tokens in the text.
//! - Byte-level BPE (`gpt2`) with each family's pre-tokenizer type
//!   (`tokenizer.ggml.pre`: Llama 3, Qwen2, DeepSeek LLM/Coder/V3, Kimi K2,
//!   GPT-4o, Tekken, GLM-4): a small vocabulary trained by
//!   `reference/bpe_pretokenizers.py` with the `tokenizers` package and the
//!   family's own splits, whose encodings are the reference. llama.cpp
//!   gives the same ids for every case (checked when the script changes;
//!   llama.cpp is not built in the tests).

use std::path::Path;

use shardplane_engine::tokenizer::Tokenizer;
use shardplane_formats::gguf::GgufHeader;

#[derive(serde::Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
    decoded: Option<String>,
}

fn reference(script: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/reference")
        .join(script);
    shardplane_testkit::run_reference(&script, &[dir.path().as_os_str()]);
    dir
}

fn header(dir: &Path, variant: &str) -> GgufHeader {
    let file = std::fs::File::open(dir.join(format!("{variant}.gguf"))).unwrap();
    GgufHeader::read(std::io::BufReader::new(file)).unwrap()
}

fn cases(dir: &Path, variant: &str) -> Vec<Case> {
    let text = std::fs::read_to_string(dir.join(format!("{variant}.json"))).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Our ids equal the reference's for every case (and our decoding its
/// decoding), and most cases merge pieces.
fn encodes_as_reference(dir: &Path, variant: &str, tokenizer: &Tokenizer) {
    let cases = cases(dir, variant);
    assert!(cases.len() > 200);
    let mut merged = 0;
    for case in &cases {
        let ids = tokenizer.encode(&case.text, false).unwrap();
        assert_eq!(ids, case.ids, "{variant}: {:?}", case.text);
        merged += usize::from(case.ids.len() < case.text.chars().count());
        if let Some(decoded) = &case.decoded {
            assert_eq!(
                &tokenizer.decode(&ids, true).unwrap(),
                decoded,
                "{variant}: decoding {:?}",
                case.text
            );
        }
    }
    // The cases exercise merges, not only single characters.
    assert!(
        merged > cases.len() / 2,
        "{variant}: only {merged} of {} cases merged pieces",
        cases.len()
    );
}

fn check(dir: &Path, variant: &str) {
    let tokenizer = Tokenizer::from_gguf(&header(dir, variant)).unwrap();
    encodes_as_reference(dir, variant, &tokenizer);
    // BOS first, as llama.cpp adds it to SentencePiece models.
    let bos = tokenizer.bos_token().expect("a BOS token");
    assert_eq!(tokenizer.encode("Hello", true).unwrap()[0], bos);
    assert!(
        tokenizer
            .stop_tokens()
            .contains(&tokenizer.token_id("</s>").unwrap())
    );
    assert!(
        tokenizer
            .stop_tokens()
            .contains(&tokenizer.token_id("<end_of_turn>").unwrap())
    );
}

#[test]
fn sentencepiece_gguf_tokenizers_encode_as_sentencepiece_does() {
    let dir = reference("tiny_tokenizer.py");
    check(dir.path(), "llama");
    check(dir.path(), "gemma");
}

#[test]
fn byte_level_gguf_tokenizers_split_as_each_family_does() {
    let dir = reference("bpe_pretokenizers.py");
    let types = [
        "llama-bpe",
        "qwen2",
        "qwen35",
        "deepseek-llm",
        "deepseek-coder",
        "deepseek-v3",
        "kimi-k2",
        "gpt-4o",
        "tekken",
        "glm4",
    ];
    let mut per_type = Vec::new();
    for pre in types {
        let tokenizer = Tokenizer::from_gguf(&header(dir.path(), pre)).unwrap();
        encodes_as_reference(dir.path(), pre, &tokenizer);
        // Each type's own splits matter: the same vocabulary read as GPT-2's
        // default splitting gives other ids for some cases.
        let mut as_default = header(dir.path(), pre);
        as_default.metadata.insert(
            "tokenizer.ggml.pre".into(),
            shardplane_formats::gguf::Value::String("default".into()),
        );
        let default = Tokenizer::from_gguf(&as_default).unwrap();
        let differ = cases(dir.path(), pre)
            .iter()
            .filter(|c| default.encode(&c.text, false).unwrap() != c.ids)
            .count();
        per_type.push((pre, differ));
    }
    for (pre, differ) in &per_type {
        assert!(
            *differ > 0,
            "{pre}: GPT-2's splitting gives the same ids for every case"
        );
    }
}

#[test]
fn an_unknown_pre_tokenizer_type_names_itself_and_the_supported_ones() {
    let dir = reference("bpe_pretokenizers.py");
    let mut header = header(dir.path(), "qwen2");
    header.metadata.insert(
        "tokenizer.ggml.pre".into(),
        shardplane_formats::gguf::Value::String("made-up-bpe".into()),
    );
    let err = Tokenizer::from_gguf(&header).unwrap_err().to_string();
    assert!(err.contains("\"made-up-bpe\""), "{err}");
    assert!(
        err.contains("deepseek-v3") && err.contains("kimi-k2"),
        "{err}"
    );
}
