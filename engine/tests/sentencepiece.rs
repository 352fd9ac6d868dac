//! SentencePiece tokenizers in GGUF (`tokenizer.ggml.model = llama`: Llama 2,
//! Mistral, Gemma) tokenize as SentencePiece itself does. The reference is
//! a small BPE model trained by `reference/tiny_tokenizer.py` with the
//! `sentencepiece` package, written as GGUF metadata the way llama.cpp's
//! converter writes it: with and without the space prefix, byte fallback
//! for characters outside the vocabulary, and control tokens in the text.

use std::path::Path;

use shardplane_engine::tokenizer::Tokenizer;
use shardplane_formats::gguf::GgufHeader;

#[derive(serde::Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
    decoded: Option<String>,
}

fn reference() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/tiny_tokenizer.py");
    shardplane_testkit::run_reference(&script, &[dir.path().as_os_str()]);
    dir
}

fn check(dir: &Path, variant: &str) {
    let file = std::fs::File::open(dir.join(format!("{variant}.gguf"))).unwrap();
    let header = GgufHeader::read(std::io::BufReader::new(file)).unwrap();
    let tokenizer = Tokenizer::from_gguf(&header).unwrap();
    let cases: Vec<Case> = serde_json::from_str(
        &std::fs::read_to_string(dir.join(format!("{variant}.json"))).unwrap(),
    )
    .unwrap();
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
        "{variant}: only {merged} cases merged pieces"
    );
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
    let dir = reference();
    check(dir.path(), "llama");
    check(dir.path(), "gemma");
}
