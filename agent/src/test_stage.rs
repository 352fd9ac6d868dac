//! A stage for tests of the scheduler and the data plane: it echoes each
//! row's position in its sequence and records the make-up of every step.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use shardplane_engine::{
    Activations, ModelConfig, SequenceId, Stage, StageInput, StageLayout, StageOutput,
};

/// A worker running `stage` under the default budget, reporting to no one.
pub(crate) fn quiet_worker(name: &str, stage: Box<dyn Stage>) -> crate::stage::StageWorker {
    crate::stage::StageWorker::start(
        name,
        stage,
        Arc::new(|_| {}),
        crate::scheduler::Budget::default(),
        Box::new(|_| {}),
    )
}

/// Each step's make-up: (sequence, rows) per part.
pub(crate) type Steps = Arc<Mutex<Vec<Vec<(SequenceId, usize)>>>>;

/// A stage that echoes: its output row for a token is the token's
/// position in its sequence, and it records every step's make-up.
pub(crate) struct Echo {
    config: ModelConfig,
    layout: StageLayout,
    held: HashMap<SequenceId, usize>,
    steps: Steps,
    last: bool,
    /// Panic in every pass (a stage whose thread breaks).
    pub(crate) panics: bool,
    /// Tokens a new sequence's prompt finds in the prefix cache (all but its
    /// last at most).
    pub(crate) cached: usize,
    /// Sequences whose tokens were offered to the prefix cache, in order.
    pub(crate) retained: Arc<Mutex<Vec<SequenceId>>>,
    /// How long every pass takes.
    pub(crate) pass: std::time::Duration,
    /// Keep the prompts offered to the prefix cache and find new prompts'
    /// longest common beginning with them (instead of `cached`).
    pub(crate) remember: bool,
    /// The tokens each sequence was given, and the prompts kept.
    tokens: HashMap<SequenceId, Vec<u32>>,
    kept: Vec<Vec<u32>>,
}

impl Echo {
    /// A stage of a 2-layer model: the first (tokens in) or the whole
    /// model (one logit out: the last row's position).
    pub(crate) fn new(last: bool) -> (Self, Steps) {
        let steps = Arc::new(Mutex::new(Vec::new()));
        let config = ModelConfig {
            architecture: shardplane_engine::Architecture::Llama,
            layers: 2,
            hidden_size: 1,
            intermediate_size: 1,
            heads: 1,
            kv_heads: 1,
            head_dim: 1,
            vocab_size: 1000,
            context_length: 4096,
            rope_theta: 1.0,
            rms_eps: 1e-5,
            attention_scale: 1.0,
            embedding_scale: 1.0,
            sliding: None,
            rope_scale: 1.0,
            yarn: None,
            rope_factors: None,
            moe: None,
            latent: None,
        };
        let layout = if last {
            StageLayout::whole(2)
        } else {
            StageLayout::new(0..1, 2).unwrap()
        };
        (
            Echo {
                config,
                layout,
                held: HashMap::new(),
                steps: steps.clone(),
                last,
                panics: false,
                cached: 0,
                retained: Arc::default(),
                pass: std::time::Duration::ZERO,
                remember: false,
                tokens: HashMap::new(),
                kept: Vec::new(),
            },
            steps,
        )
    }
}

impl Echo {
    /// The middle stage of a 3-layer model: hidden states in and out.
    pub(crate) fn middle() -> Self {
        let (mut echo, _) = Echo::new(false);
        echo.config.layers = 3;
        echo.layout = StageLayout::new(1..2, 3).unwrap();
        echo
    }
}

impl Echo {
    /// Keeps `seq`'s tokens when remembering, only when every row was told
    /// its token (as the engines keep only such).
    fn keep_told(&mut self, seq: SequenceId) {
        if self.remember
            && let Some(t) = self.tokens.get(&seq)
            && Some(&t.len()) == self.held.get(&seq)
        {
            self.kept.push(t.clone());
        }
    }
}

impl Stage for Echo {
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn layout(&self) -> &StageLayout {
        &self.layout
    }
    fn context_length(&self) -> usize {
        4096
    }
    fn forward_batch(
        &mut self,
        batch: Vec<(SequenceId, StageInput)>,
    ) -> shardplane_engine::Result<Vec<StageOutput>> {
        assert!(!self.panics, "the test stage broke");
        std::thread::sleep(self.pass);
        self.steps
            .lock()
            .unwrap()
            .push(batch.iter().map(|(s, i)| (*s, i.len())).collect());
        Ok(batch
            .into_iter()
            .map(|(seq, input)| {
                let ids = match &input {
                    StageInput::Tokens(ids) => ids.as_slice(),
                    StageInput::Hidden(rows) => rows.ids.as_slice(),
                };
                self.tokens.entry(seq).or_default().extend(ids);
                let start = *self.held.get(&seq).unwrap_or(&0);
                let n = input.len();
                self.held.insert(seq, start + n);
                let rows: Vec<f32> = (start..start + n).map(|p| p as f32).collect();
                if self.last {
                    StageOutput::Logits(vec![*rows.last().unwrap()])
                } else {
                    StageOutput::Hidden(Activations::new(n, 1, rows).unwrap())
                }
            })
            .collect())
    }
    fn release(&mut self, seq: SequenceId) -> bool {
        // As the engines do, a released sequence keeps its tokens' blocks.
        self.keep_told(seq);
        self.tokens.remove(&seq);
        self.held.remove(&seq).is_some()
    }
    fn reuse_prefix(&mut self, seq: SequenceId, tokens: &[u32]) -> usize {
        let found = match self.remember {
            true => self
                .kept
                .iter()
                .map(|k| k.iter().zip(tokens).take_while(|(a, b)| a == b).count())
                .max()
                .unwrap_or(0),
            false => self.cached,
        };
        let n = found.min(tokens.len().saturating_sub(1));
        if n > 0 {
            self.held.insert(seq, n);
            self.tokens.insert(seq, tokens[..n].to_vec());
        }
        n
    }
    fn retain_prefix(&mut self, seq: SequenceId) {
        self.retained.lock().unwrap().push(seq);
        self.keep_told(seq);
    }
    fn prefix_cache(&self) -> shardplane_engine::prefix::PrefixCacheStats {
        shardplane_engine::prefix::PrefixCacheStats {
            budget_bytes: u64::from(self.remember || self.cached > 0),
            ..Default::default()
        }
    }
    fn sequence_len(&self, seq: SequenceId) -> usize {
        *self.held.get(&seq).unwrap_or(&0)
    }
    fn sequences(&self) -> usize {
        self.held.len()
    }
    fn weight_bytes(&self) -> usize {
        0
    }
    fn kv_cache_bytes(&self) -> usize {
        0
    }
}
