//! KV caches kept in each family's layout, over sequences longer than the
//! reference test's: Gemma 3's sliding layers hold about two windows of
//! rows however long the sequence, and still give mlx-lm's logits at every
//! one of 1100 positions, on every engine and format, whole and split; a
//! prompt run again starts from the prefix cache when the blocks its window
//! reaches were kept, and computes in full when they were not; DeepSeek's
//! latent rows go through the prefix cache too.
//!
//! ```text
//!  tiny_model.py --forced 1100 ──► 1100 random tokens, mlx-lm's logits after
//!                                  each (one pass, no cache)
//!  engine: 20 as a prompt, then one a step ──► every row compared; the KV
//!          bytes of the stage of sliding layers stay bounded
//! ```

mod common;

use common::{Loader, Tiny, candle, gap, tiny, tiny_with};
use shardplane_engine::candle::CandleStage;
use shardplane_engine::pipeline::LocalPipeline;
use shardplane_engine::{KvPrecision, LoadOptions, Stage, StageInput, StageLayout, StageOutput};

/// Tokens of the long sequence: past MLX's second growth of a cache
/// (chunks of 256) and hundreds of windows of 4.
const LONG: usize = 1100;

/// Tokens fed as the prompt before the rest goes one a step.
const PROMPT: usize = 20;

/// Tokens of each slice of the sequence that goes in slices.
const SLICE: usize = 37;

/// Logits within this fraction of the reference row's range (the engines
/// sum in another order than mlx-lm over a long sequence).
const TOLERANCE: f32 = 1e-4;

fn long_gemma() -> Tiny {
    tiny_with("gemma3_text", &["--forced", &LONG.to_string()])
}

fn logits(out: StageOutput) -> Vec<f32> {
    match out {
        StageOutput::Logits(l) => l,
        StageOutput::Hidden(_) => panic!("a whole model gives logits"),
    }
}

/// Runs the forced sequence through `p` twice at once: as sequence `seq` in
/// slices of [`SLICE`] tokens (prompt slices that meet forgotten rows), and
/// as `seq + 1`, [`PROMPT`] tokens and then one a step beside it; checks the
/// logits of every step of both against the reference, and returns each
/// stage's most KV bytes.
fn run_long(what: &str, p: &mut LocalPipeline, t: &Tiny, seq: u64) -> Vec<usize> {
    let r = &t.reference;
    assert_eq!(
        r.forced.len(),
        LONG,
        "the reference has the forced sequence"
    );
    let mut most = vec![0usize; p.stages().len()];
    // Tokens fed so far, per sequence.
    let mut fed = [0usize; 2];
    loop {
        let batch: Vec<(u64, Vec<u32>)> = (0..2)
            .filter(|&i| fed[i] < LONG)
            .map(|i| {
                let n = match (i, fed[i]) {
                    (0, _) => SLICE,
                    (_, 0) => PROMPT,
                    _ => 1,
                };
                let end = (fed[i] + n).min(LONG);
                (seq + i as u64, r.forced[fed[i]..end].to_vec())
            })
            .collect();
        if batch.is_empty() {
            break;
        }
        let rows = p.step(batch.clone()).unwrap();
        for ((s, input), row) in batch.iter().zip(rows) {
            let i = (s - seq) as usize;
            fed[i] += input.len();
            let at = fed[i] - 1;
            let g = gap(&row, &r.forced_logits[at]);
            assert!(
                g < TOLERANCE,
                "{what}: sequence {s} at position {at} differs by {g} of the logit range"
            );
        }
        for (m, stage) in most.iter_mut().zip(p.stages()) {
            *m = (*m).max(stage.kv_cache_bytes());
        }
    }
    p.release(seq);
    p.release(seq + 1);
    most
}

fn engines(t: &Tiny) -> Vec<(&'static str, Loader<'_>)> {
    let mut engines = vec![
        ("candle, safetensors", candle(&t.mlx)),
        ("candle, GGUF", candle(&t.gguf)),
    ];
    #[cfg(feature = "mlx")]
    {
        engines.push(("MLX, safetensors", common::mlx(&t.mlx)));
        engines.push(("MLX, GGUF", common::mlx(&t.gguf)));
    }
    engines
}

/// The tiny Gemma 3: layers 0-4 slide (window 4), 5 is global, 6 slides;
/// 2 KV heads of 16 floats, keys and values in f32.
const ROW_BYTES: usize = 2 * 2 * 16 * 4;

#[test]
fn gemma3_sliding_layers_hold_a_window_and_match_mlx_lm_over_a_long_sequence() {
    let t = long_gemma();
    for (engine, load) in engines(&t) {
        // Whole, and the five sliding layers apart from the global one.
        #[allow(clippy::single_range_in_vec_init)]
        let splits = [vec![0..7], vec![0..5, 5..7]];
        for ranges in splits {
            let what = format!("{engine}, stages {ranges:?}");
            let stages = ranges
                .iter()
                .map(|r| load(StageLayout::new(r.clone(), t.layers).unwrap()))
                .collect();
            let mut p = LocalPipeline::from_stages(stages);
            let most = run_long(&what, &mut p, &t, 1);
            if ranges.len() == 2 {
                // Two sequences in five sliding layers: at most 512 rows
                // each (MLX's arrays: a chunk for the rows kept and one of
                // room; candle's buffer: one chunk), where keeping every
                // row would take 1100 or more.
                let bound = 2 * 5 * 512 * ROW_BYTES;
                assert!(
                    most[0] > 0 && most[0] <= bound,
                    "{what}: the sliding stage held {} bytes of KV (bound {bound})",
                    most[0]
                );
                // The global layer keeps every row of both.
                assert!(most[1] >= 2 * LONG * ROW_BYTES, "{what}: {} bytes", most[1]);
            }
            eprintln!("{what}: most KV bytes per stage {most:?}");
        }
    }
}

/// Whole models with a prefix cache, on each engine.
fn cached_stages(t: &Tiny) -> Vec<(&'static str, Box<dyn Stage>)> {
    // An f32 KV cache, as the references hold theirs.
    let options = LoadOptions {
        dequantize: true,
        prefix_cache_bytes: 64 << 20,
        kv_precision: KvPrecision::F32,
        ..Default::default()
    };
    let whole = StageLayout::whole(t.layers);
    #[allow(unused_mut)]
    let mut stages: Vec<(&str, Box<dyn Stage>)> = vec![(
        "candle",
        Box::new(CandleStage::load(&t.mlx, whole.clone(), &options).unwrap()),
    )];
    #[cfg(feature = "mlx")]
    stages.push((
        "MLX",
        Box::new(shardplane_engine::mlx::MlxStage::load(&t.mlx, whole, &options).unwrap()),
    ));
    stages
}

/// After a long sequence left, its blocks are kept with the sliding layers'
/// rows missing where they were forgotten: the same sequence again starts
/// from the cache (its window's blocks are there) and gives the reference's
/// logits; a prompt that ends where the sliding rows are gone is not served
/// from the cache (nor counted as a hit) and is computed in full, correctly;
/// and then its own complete blocks take the incomplete ones' place.
#[test]
fn gemma3_reuses_cached_blocks_only_where_its_window_was_kept() {
    let t = long_gemma();
    let r = &t.reference;
    for (engine, stage) in cached_stages(&t) {
        let mut p = LocalPipeline::from_stages(vec![stage]);
        run_long(engine, &mut p, &t, 1);
        let stage = &mut p.stages_mut()[0];
        let before = stage.prefix_cache().hit_tokens;
        // The whole sequence again: all but its last token from the cache.
        let reused = stage.reuse_prefix(2, &r.forced);
        assert_eq!(reused, LONG - 1, "{engine}: the window's blocks were kept");
        let rest = StageInput::Tokens(r.forced[reused..].to_vec());
        let row = logits(stage.forward(2, rest).unwrap());
        let g = gap(&row, &r.forced_logits[LONG - 1]);
        assert!(
            g < TOLERANCE,
            "{engine}: {g} of the logit range after the cached blocks"
        );
        assert_eq!(stage.prefix_cache().hit_tokens, before + LONG as u64 - 1);
        stage.release(2);
        // A prompt ending mid-way: its sliding layers' rows there are gone.
        // Sixteen whole blocks and one token: every block its window needs
        // is one the long sequences stored.
        let mid = 16 * shardplane_engine::prefix::DEFAULT_BLOCK_TOKENS + 1;
        let early = &r.forced[..mid];
        let before = stage.prefix_cache().hit_tokens;
        assert_eq!(
            stage.reuse_prefix(3, early),
            0,
            "{engine}: nothing to start from"
        );
        assert_eq!(
            stage.prefix_cache().hit_tokens,
            before,
            "{engine}: no hit counted"
        );
        let row = logits(
            stage
                .forward(3, StageInput::Tokens(early.to_vec()))
                .unwrap(),
        );
        let g = gap(&row, &r.forced_logits[mid - 1]);
        assert!(
            g < TOLERANCE,
            "{engine}: {g} of the logit range computed in full"
        );
        stage.release(3);
        // That sequence, its prompt run in one step, held every row: its
        // blocks fill in those the long one left without the sliding rows,
        // and the prompt again starts from the cache.
        assert_eq!(stage.reuse_prefix(4, early), mid - 1, "{engine}: filled in");
        let rest = StageInput::Tokens(early[mid - 1..].to_vec());
        let row = logits(stage.forward(4, rest).unwrap());
        let g = gap(&row, &r.forced_logits[mid - 1]);
        assert!(
            g < TOLERANCE,
            "{engine}: {g} of the logit range from filled-in blocks"
        );
        stage.release(4);
    }
}

/// DeepSeek V3's latent cache rows go through the prefix cache: a prompt of
/// two whole blocks and a few tokens, run again after its first sequence
/// left, starts from the cached blocks and tail (all but its last token) and
/// gives the same logits.
#[test]
fn deepseek_v3_starts_from_cached_latent_blocks_on_both_engines() {
    let t = tiny("deepseek_v3");
    let block = shardplane_engine::prefix::DEFAULT_BLOCK_TOKENS;
    let prompt: Vec<u32> = (0..2 * block as u32 + 6)
        .map(|i| (i * 37 + 11) % 256)
        .collect();
    for (engine, mut stage) in cached_stages(&t) {
        let whole = logits(
            stage
                .forward(1, StageInput::Tokens(prompt.clone()))
                .unwrap(),
        );
        assert!(stage.release(1));
        let reused = stage.reuse_prefix(2, &prompt);
        assert_eq!(
            reused,
            prompt.len() - 1,
            "{engine}: the whole blocks and the tail after them (all but the last token) come \
             from the cache"
        );
        let rest = StageInput::Tokens(prompt[reused..].to_vec());
        let again = logits(stage.forward(2, rest).unwrap());
        let g = gap(&again, &whole);
        assert!(
            g < 1e-5,
            "{engine}: {g} of the logit range from the uncached run"
        );
        assert_eq!(stage.prefix_cache().hit_tokens, prompt.len() as u64 - 1);
    }
}
