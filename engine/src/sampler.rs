//! Choosing the next token from logits: penalties, temperature, top-k, top-p,
//! min-p, and a seeded random choice (greedy at temperature 0).

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::constraint::TokenMask;
use crate::error::{Error, Result};

/// How to pick tokens and when to stop.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 picks the most likely token (greedy); higher values flatten the distribution.
    pub temperature: f32,
    /// Keep only the `k` most likely tokens (0 or unset: all).
    pub top_k: Option<usize>,
    /// Keep the most likely tokens whose probabilities add up to `p` (0 < p <= 1).
    pub top_p: Option<f32>,
    /// Drop tokens less likely than `min_p` times the most likely one (0 <= min_p <= 1).
    pub min_p: Option<f32>,
    /// Divides the logits of tokens already seen (prompt and output) when above
    /// 1 (llama.cpp and Hugging Face style); 1 is off.
    pub repetition_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated (OpenAI style).
    pub frequency_penalty: f32,
    /// Subtracted from a token's logit if it was generated at all (OpenAI style).
    pub presence_penalty: f32,
    /// Seed of the random choice; the same seed gives the same tokens.
    pub seed: Option<u64>,
    /// The most tokens to generate.
    pub max_tokens: usize,
    /// Texts that end the generation when they appear (they are not returned).
    pub stop: Vec<String>,
    /// Never pick end-of-sequence tokens, so every run generates `max_tokens`
    /// (for benchmarks).
    pub ignore_eos: bool,
    /// Give each picked token's log-probability and this many of the most
    /// likely tokens with theirs (at most [`MAX_TOP_LOGPROBS`]).
    pub logprobs: Option<usize>,
}

/// The most alternatives a token's log-probabilities can list.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A picked token's log-probability and the most likely tokens' (most
/// likely first), under the model's own distribution: the softmax of the
/// logits before penalties, temperature, truncation or a grammar.
#[derive(Debug, Clone, PartialEq)]
pub struct Logprobs {
    /// The token picked.
    pub token: u32,
    /// Its log-probability (natural log, ≤ 0).
    pub logprob: f32,
    /// The most likely tokens and theirs.
    pub top: Vec<(u32, f32)>,
}

impl Logprobs {
    /// The log-probabilities of `token` and of the `n` most likely tokens
    /// in `logits` (ties by lower id).
    pub fn of(logits: &[f32], token: u32, n: usize) -> Self {
        let max = logits
            .iter()
            .copied()
            .filter(|l| l.is_finite())
            .fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits
            .iter()
            .filter(|l| l.is_finite())
            .map(|&l| ((l - max) as f64).exp())
            .sum();
        let log_total = max + sum.ln() as f32;
        let logprob = |l: f32| {
            if l.is_finite() {
                l - log_total
            } else {
                f32::NEG_INFINITY
            }
        };
        let mut top: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| (i as u32, l))
            .collect();
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if n > 0 && n < top.len() {
            top.select_nth_unstable_by(n - 1, by_logit);
        }
        top.truncate(n);
        top.sort_unstable_by(by_logit);
        Logprobs {
            token,
            logprob: logprob(
                logits
                    .get(token as usize)
                    .copied()
                    .unwrap_or(f32::NEG_INFINITY),
            ),
            top: top.into_iter().map(|(t, l)| (t, logprob(l))).collect(),
        }
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            min_p: None,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: None,
            max_tokens: 256,
            stop: Vec::new(),
            ignore_eos: false,
            logprobs: None,
        }
    }
}

impl SamplingParams {
    /// Checks every parameter's range.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Sampling(m));
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(format!(
                "temperature {} must be 0 or more",
                self.temperature
            ));
        }
        if let Some(p) = self.top_p
            && !(p > 0.0 && p <= 1.0)
        {
            return bad(format!("top_p {p} must be above 0 and at most 1"));
        }
        if let Some(p) = self.min_p
            && !(0.0..=1.0).contains(&p)
        {
            return bad(format!("min_p {p} must be between 0 and 1"));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad(format!(
                "repetition_penalty {} must be above 0",
                self.repetition_penalty
            ));
        }
        for (name, v) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if !(v.is_finite() && (-2.0..=2.0).contains(&v)) {
                return bad(format!("{name} {v} must be between -2 and 2"));
            }
        }
        if self.stop.iter().any(String::is_empty) {
            return bad("stop strings must not be empty".into());
        }
        if let Some(n) = self.logprobs
            && n > MAX_TOP_LOGPROBS
        {
            return bad(format!(
                "top log-probabilities {n} must be at most {MAX_TOP_LOGPROBS}"
            ));
        }
        Ok(())
    }
}

/// Picks tokens for one sequence.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// Tokens of the prompt and output, for the repetition penalty.
    seen: HashMap<u32, ()>,
    /// The last picked token's log-probabilities, when asked for.
    logprobs: Option<Logprobs>,
    /// How often each token was generated, for frequency and presence penalties.
    generated: HashMap<u32, u32>,
}

impl Sampler {
    /// A sampler for `params` (validated) over a sequence starting with `prompt`.
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Result<Self> {
        params.validate()?;
        let rng = match params.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        Ok(Sampler {
            seen: prompt.iter().map(|&t| (t, ())).collect(),
            generated: HashMap::new(),
            logprobs: None,
            params,
            rng,
        })
    }

    /// A sampler for an answer that goes on after `generated` tokens of it
    /// (resumed elsewhere after a failure, or run again after a
    /// preemption): the penalties count them as generated, and a seeded
    /// random choice goes on where it was after them (each random choice
    /// takes one draw), so the rest is what the answer would have been.
    pub fn resumed(params: SamplingParams, prompt: &[u32], generated: &[u32]) -> Result<Self> {
        let mut s = Self::new(params, prompt)?;
        for &token in generated {
            if s.params.temperature != 0.0 {
                let _: f32 = s.rng.random();
            }
            s.seen.insert(token, ());
            *s.generated.entry(token).or_default() += 1;
        }
        Ok(s)
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from `logits` (changed in place) and records it.
    pub fn sample(&mut self, logits: &mut [f32]) -> u32 {
        self.sample_within(logits, None)
    }

    /// Like [`Sampler::sample`], choosing only among the tokens `allowed`
    /// (an output grammar's next tokens), when given.
    pub fn sample_within(&mut self, logits: &mut [f32], allowed: Option<&TokenMask>) -> u32 {
        // The model's own distribution, before anything below changes it.
        let raw = self.params.logprobs.map(|_| logits.to_vec());
        if let Some(mask) = allowed {
            mask.apply(logits);
        }
        self.apply_penalties(logits);
        let token = if self.params.temperature == 0.0 {
            argmax(logits)
        } else {
            self.sample_random(logits)
        };
        self.seen.insert(token, ());
        *self.generated.entry(token).or_default() += 1;
        self.logprobs = raw.map(|raw| Logprobs::of(&raw, token, self.params.logprobs.unwrap_or(0)));
        token
    }

    /// The log-probabilities of the token picked last, when the parameters
    /// ask for them (taken: the next call gives the next token's).
    pub fn take_logprobs(&mut self) -> Option<Logprobs> {
        self.logprobs.take()
    }

    fn apply_penalties(&self, logits: &mut [f32]) {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            for &t in self.seen.keys() {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
        }
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            for (&t, &n) in &self.generated {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= p.frequency_penalty * n as f32 + p.presence_penalty;
                }
            }
        }
    }

    fn sample_random(&mut self, logits: &[f32]) -> u32 {
        // One draw per choice, whatever the logits: see `Sampler::resumed`.
        let draw: f32 = self.rng.random();
        let p = &self.params;
        let mut candidates: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| (i as u32, l / p.temperature))
            .collect();
        if candidates.is_empty() {
            return argmax(logits);
        }
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        match p.top_k {
            Some(k) if k > 0 && k < candidates.len() => {
                candidates.select_nth_unstable_by(k - 1, by_logit);
                candidates.truncate(k);
            }
            _ => {}
        }
        // Softmax over what is left (no order needed for it).
        let max = candidates
            .iter()
            .map(|c| c.1)
            .fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0.0f64;
        for c in candidates.iter_mut() {
            c.1 = (c.1 - max).exp();
            total += c.1 as f64;
        }
        for c in candidates.iter_mut() {
            c.1 = (c.1 as f64 / total) as f32;
        }
        if let Some(min_p) = p.min_p {
            // The most likely token's probability is 1 / total.
            let floor = (1.0 / total) as f32 * min_p;
            candidates.retain(|c| c.1 >= floor);
        }
        // top_p 1 (what many clients send) keeps every token.
        if let Some(top_p) = p.top_p.filter(|&t| t < 1.0) {
            keep_top_p(&mut candidates, top_p, by_logit);
        }
        // Without top_p the order does not matter: any order of the same
        // probabilities draws from the same distribution.
        let total: f32 = candidates.iter().map(|c| c.1).sum();
        let mut r = draw * total;
        for &(token, prob) in &candidates {
            if r < prob {
                return token;
            }
            r -= prob;
        }
        candidates.last().expect("at least one candidate").0
    }
}

/// Keeps the smallest set of the most likely `candidates` whose
/// probabilities reach `top_p`, most likely first. Sorts only as many as it
/// needs: the most likely 64, then the next most likely up to four times as
/// many, and so on, each round choosing among the tokens the rounds before
/// left (a whole vocabulary's sort took milliseconds a token).
fn keep_top_p(
    candidates: &mut Vec<(u32, f32)>,
    top_p: f32,
    by_logit: impl Fn(&(u32, f32), &(u32, f32)) -> std::cmp::Ordering + Copy,
) {
    // `candidates[..sorted]` are the most likely, in order, and sum to
    // `cumulative`, below `top_p`.
    let (mut sorted, mut cumulative) = (0, 0.0);
    let mut n = candidates.len().min(64);
    loop {
        let rest = &mut candidates[sorted..];
        let take = n - sorted;
        if take < rest.len() {
            rest.select_nth_unstable_by(take - 1, by_logit);
        }
        rest[..take].sort_unstable_by(by_logit);
        for i in sorted..n {
            cumulative += candidates[i].1;
            if cumulative >= top_p {
                candidates.truncate(i + 1);
                return;
            }
        }
        if n == candidates.len() {
            return;
        }
        sorted = n;
        n = (n * 4).min(candidates.len());
    }
}

/// The index of the largest logit (the lowest index among equals).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams {
            temperature: 1.0,
            seed: Some(7),
            ..Default::default()
        };
        f(&mut p);
        p
    }

    fn draw(p: SamplingParams, logits: &[f32], n: usize) -> Vec<u32> {
        let mut s = Sampler::new(p, &[]).unwrap();
        (0..n).map(|_| s.sample(&mut logits.to_vec())).collect()
    }

    /// The whole vocabulary sorted, then top_p: what the sampler must
    /// agree with, given the same draw.
    fn top_p_by_full_sort(logits: &[f32], p: &SamplingParams, draw: f32) -> u32 {
        let mut c: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l / p.temperature))
            .collect();
        c.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let max = c[0].1;
        let total: f64 = c.iter().map(|x| (x.1 - max).exp() as f64).sum();
        let probs: Vec<(u32, f32)> = c
            .iter()
            .map(|x| (x.0, ((x.1 - max).exp() as f64 / total) as f32))
            .collect();
        let (mut cumulative, mut keep) = (0.0, probs.len());
        for (i, x) in probs.iter().enumerate() {
            cumulative += x.1;
            if cumulative >= p.top_p.unwrap() {
                keep = i + 1;
                break;
            }
        }
        let kept = &probs[..keep];
        let mut r = draw * kept.iter().map(|x| x.1).sum::<f32>();
        for &(t, prob) in kept {
            if r < prob {
                return t;
            }
            r -= prob;
        }
        kept.last().unwrap().0
    }

    /// Logits of a vocabulary of `n` from a fixed generator, peaked like a
    /// model's (a few likely tokens, a long tail).
    fn vocabulary(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n)
            .map(|_| {
                let u: f32 = rng.random();
                if u < 0.002 {
                    8.0 + 4.0 * u / 0.002
                } else {
                    6.0 * u
                }
            })
            .collect()
    }

    #[test]
    fn top_p_sorting_only_the_likely_tokens_picks_what_a_full_sort_picks() {
        for case in 0..120u64 {
            let logits = vocabulary(49_152, case);
            let p = params(|p| {
                p.seed = Some(case);
                p.temperature = [0.6, 1.0, 1.6][case as usize % 3];
                p.top_p = Some([0.5, 0.9, 0.95, 0.99, 0.999][case as usize % 5]);
            });
            let mut s = Sampler::new(p.clone(), &[]).unwrap();
            let draw: f32 = s.rng.clone().random();
            let picked = s.sample(&mut logits.clone());
            assert_eq!(picked, top_p_by_full_sort(&logits, &p, draw), "case {case}");
        }
    }

    #[test]
    fn without_top_p_tokens_are_drawn_by_their_probabilities() {
        let logits = [2.0f32, 1.0, 0.5, 0.0, -1.0];
        let exp: Vec<f64> = logits.iter().map(|&l| (l as f64).exp()).collect();
        let total: f64 = exp.iter().sum();
        let n = 40_000;
        let picks = draw(params(|_| {}), &logits, n);
        for (t, e) in exp.iter().enumerate() {
            let seen = picks.iter().filter(|&&x| x == t as u32).count() as f64 / n as f64;
            assert!(
                (seen - e / total).abs() < 0.01,
                "token {t}: {seen} vs {}",
                e / total
            );
        }
        // min_p keeps the tokens at least 0.3 times as likely as the first.
        let picks = draw(params(|p| p.min_p = Some(0.3)), &logits, 2_000);
        assert!(picks.iter().all(|&t| t <= 1), "only 0 and 1 are within 0.3");
        assert!(picks.contains(&1));
    }

    #[test]
    fn greedy_takes_the_largest_and_the_first_of_ties() {
        assert_eq!(argmax(&[0.1, 3.0, 3.0, -1.0]), 1);
        let p = SamplingParams::default();
        assert_eq!(draw(p, &[0.0, 1.0, 5.0], 3), vec![2, 2, 2]);
    }

    #[test]
    fn the_same_seed_gives_the_same_tokens() {
        let logits: Vec<f32> = (0..100).map(|i| (i % 7) as f32 * 0.3).collect();
        let a = draw(params(|_| {}), &logits, 50);
        let b = draw(params(|_| {}), &logits, 50);
        let c = draw(params(|p| p.seed = Some(8)), &logits, 50);
        assert_eq!(a, b);
        assert_ne!(a, c, "another seed gives another sequence");
    }

    #[test]
    fn a_resumed_sampler_goes_on_as_the_first_would_have() {
        let logits: Vec<f32> = (0..100).map(|i| (i % 7) as f32 * 0.3).collect();
        let p = params(|p| {
            p.frequency_penalty = 0.5;
            p.presence_penalty = 0.3;
        });
        let all = {
            let mut s = Sampler::new(p.clone(), &[1, 2]).unwrap();
            (0..50)
                .map(|_| s.sample(&mut logits.clone()))
                .collect::<Vec<_>>()
        };
        let mut resumed = Sampler::resumed(p, &[1, 2], &all[..20]).unwrap();
        let rest: Vec<u32> = (0..30)
            .map(|_| resumed.sample(&mut logits.clone()))
            .collect();
        assert_eq!(rest, all[20..]);
    }

    #[test]
    fn top_k_one_is_greedy_and_top_k_limits_the_choice() {
        let logits = [1.0, 2.0, 3.0, 4.0, 5.0];
        assert!(
            draw(params(|p| p.top_k = Some(1)), &logits, 20)
                .iter()
                .all(|&t| t == 4)
        );
        let picks = draw(params(|p| p.top_k = Some(2)), &logits, 200);
        assert!(picks.iter().all(|&t| t == 3 || t == 4), "{picks:?}");
        assert!(picks.contains(&3) && picks.contains(&4));
        // k larger than the vocabulary keeps everything.
        assert_eq!(draw(params(|p| p.top_k = Some(99)), &logits, 5).len(), 5);
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_p() {
        // Probabilities about 0.64, 0.24, 0.09, 0.03.
        let logits = [3.0, 2.0, 1.0, 0.0];
        let picks = draw(params(|p| p.top_p = Some(0.5)), &logits, 100);
        assert!(
            picks.iter().all(|&t| t == 0),
            "the first token alone reaches 0.5"
        );
        let picks = draw(params(|p| p.top_p = Some(0.8)), &logits, 300);
        assert!(
            picks.iter().all(|&t| t <= 1) && picks.contains(&1),
            "{picks:?}"
        );
        let all = draw(params(|p| p.top_p = Some(1.0)), &logits, 2000);
        assert!(all.contains(&3), "top_p 1 keeps every token");
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        let logits = [3.0, 2.9, 0.0, -1.0];
        let picks = draw(params(|p| p.min_p = Some(0.5)), &logits, 300);
        assert!(picks.iter().all(|&t| t <= 1), "{picks:?}");
    }

    #[test]
    fn penalties_push_down_repeated_tokens() {
        let prompt = [0u32];
        let mut s = Sampler::new(
            SamplingParams {
                repetition_penalty: 2.0,
                ..Default::default()
            },
            &prompt,
        )
        .unwrap();
        assert_eq!(
            s.sample(&mut [2.0, 1.5]),
            1,
            "token 0 is in the prompt: 2.0 / 2 < 1.5"
        );
        let mut s = Sampler::new(
            SamplingParams {
                frequency_penalty: 1.0,
                ..Default::default()
            },
            &[],
        )
        .unwrap();
        assert_eq!(s.sample(&mut [2.0, 1.5]), 0);
        assert_eq!(
            s.sample(&mut [2.0, 1.5]),
            1,
            "generated once: 2.0 - 1.0 < 1.5"
        );
        let mut s = Sampler::new(
            SamplingParams {
                presence_penalty: 0.4,
                ..Default::default()
            },
            &[],
        )
        .unwrap();
        assert_eq!(s.sample(&mut [2.0, 1.7]), 0);
        assert_eq!(s.sample(&mut [2.0, 1.7]), 1);
    }

    #[test]
    fn out_of_range_parameters_are_refused() {
        for (p, words) in [
            (params(|p| p.temperature = -1.0), "temperature"),
            (params(|p| p.top_p = Some(0.0)), "top_p"),
            (params(|p| p.top_p = Some(1.5)), "top_p"),
            (params(|p| p.min_p = Some(2.0)), "min_p"),
            (params(|p| p.repetition_penalty = 0.0), "repetition_penalty"),
            (params(|p| p.frequency_penalty = 3.0), "frequency_penalty"),
            (params(|p| p.stop = vec![String::new()]), "stop"),
        ] {
            let e = Sampler::new(p, &[]).unwrap_err().to_string();
            assert!(e.contains(words), "{e}");
        }
    }

    #[test]
    fn non_finite_logits_are_never_picked() {
        let logits = [f32::NEG_INFINITY, 0.5, f32::NAN, 0.4];
        let picks = draw(params(|_| {}), &logits, 200);
        assert!(picks.iter().all(|&t| t == 1 || t == 3), "{picks:?}");
    }

    #[test]
    fn logprobs_are_the_model_s_own_before_any_change() {
        let logits = [1.0f32, 3.0, 2.0, f32::NEG_INFINITY];
        let total: f32 = [1.0f32, 3.0, 2.0].iter().map(|l| l.exp()).sum();
        let mut s = Sampler::new(
            params(|p| {
                p.logprobs = Some(2);
                p.presence_penalty = 2.0;
            }),
            &[],
        )
        .unwrap();
        // A mask allowing only token 2: picked, with its unmasked log-probability.
        let mask = TokenMask::of(&[2]);
        assert_eq!(s.sample_within(&mut logits.clone(), Some(&mask)), 2);
        let lp = s.take_logprobs().unwrap();
        assert_eq!(lp.token, 2);
        assert!((lp.logprob - (2.0 - total.ln())).abs() < 1e-5, "{lp:?}");
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 2]);
        assert!((lp.top[0].1 - (3.0 - total.ln())).abs() < 1e-5);
        assert!(s.take_logprobs().is_none(), "taken");
        // Token 2 is now penalized: the log-probabilities stay the model's.
        let token = s.sample(&mut logits.clone());
        let again = s.take_logprobs().unwrap();
        assert_eq!((again.token, &again.top), (token, &lp.top));
        let e = Sampler::new(params(|p| p.logprobs = Some(21)), &[]).unwrap_err();
        assert!(e.to_string().contains("at most 20"), "{e}");
        let mut off = Sampler::new(params(|_| {}), &[]).unwrap();
        off.sample(&mut logits.clone());
        assert!(off.take_logprobs().is_none());
    }
}
