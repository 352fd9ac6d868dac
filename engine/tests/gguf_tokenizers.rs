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
//! - tiktoken ranks (`tiktoken.model`, Kimi K2's safetensors layout): a
//!   small vocabulary trained by `reference/tiktoken_ranks.py` with Kimi
//!   K2's splits, written as ranks, whose `tiktoken` encodings are the
//!   reference.

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

#[test]
fn tiktoken_ranks_tokenize_as_tiktoken_does() {
    // Kimi K2's layout: tiktoken.model, tokenizer_config.json naming its
    // code and special tokens, no tokenizer.json.
    let dir = reference("tiktoken_ranks.py");
    let model = dir.path().join("kimi");
    assert!(!model.join("tokenizer.json").exists());
    let text = shardplane_engine::text_model::TextModel::from_dir(&model).unwrap();
    let tokenizer = &text.tokenizer;
    encodes_as_reference(dir.path(), "kimi", tokenizer);
    // The special tokens follow the ranks: the named ones where the config
    // puts them, the rest of the 256 reserved.
    let ranks = std::fs::read_to_string(model.join("tiktoken.model"))
        .unwrap()
        .lines()
        .count() as u32;
    assert_eq!(tokenizer.token_id("[BOS]"), Some(ranks));
    assert_eq!(tokenizer.token_id("[EOS]"), Some(ranks + 1));
    assert_eq!(
        tokenizer.token_id(&format!("<|reserved_token_{}|>", ranks + 255)),
        Some(ranks + 255)
    );
    assert_eq!(tokenizer.vocab_size(), ranks as usize + 256);
    assert_eq!(tokenizer.bos_token(), Some(ranks));
    assert!(tokenizer.stop_tokens().contains(&(ranks + 1)));
    // A chat prompt through the model's template: its markers as the
    // special tokens they are.
    let prompt = text
        .chat_prompt(&[shardplane_engine::chat::ChatMessage::new(
            "user",
            "Why is the sky blue?",
        )])
        .unwrap();
    let im_user = tokenizer.token_id("<|im_user|>").unwrap();
    let im_assistant = tokenizer.token_id("<|im_assistant|>").unwrap();
    assert_eq!(prompt[0], im_user);
    assert_eq!(prompt.last(), Some(&im_assistant));
    assert_eq!(
        tokenizer.decode(&prompt, false).unwrap(),
        "<|im_user|>Why is the sky blue?<|im_end|><|im_assistant|>"
    );

    // A config naming other code is refused by name.
    let config = model.join("tokenizer_config.json");
    let other = std::fs::read_to_string(&config)
        .unwrap()
        .replace("tokenization_kimi", "tokenization_other");
    std::fs::write(&config, other).unwrap();
    let err = shardplane_engine::text_model::TextModel::from_dir(&model)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("\"tokenization_other\"") && err.contains("tokenization_kimi"),
        "{err}"
    );
}
