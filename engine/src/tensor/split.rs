//! How a layer is split across the ranks of a tensor group.
//!
//! ```text
//!  query heads  │ g0: h0 h1 h2 │ g1: h3 h4 h5 │ g2: h6 h7 h8 │   whole KV groups
//!  weights 2:1  │──────── rank 0 ────────────│─── rank 1 ───│
//!  intermediate │ u0 u1 u2 u3 │ u4 u5 │   units of 256 (or 32) columns
//! ```
//!
//! Attention is split by KV heads, each with the query heads that share it,
//! so no key or value is needed by two ranks; the MLP by intermediate
//! columns, in units that keep quantized blocks whole — with experts, every
//! rank holds every expert's share of its columns (and of a shared
//! expert's), and routes every token itself, as every rank sees the same
//! rows. Shares follow each
//! rank's weight (its memory, or a number the user gives), rounded by
//! largest remainder, and every rank gets at least one unit of each.

use std::ops::Range;

use crate::config::ModelConfig;
use crate::error::{Error, Result};

/// What one rank of a group computes in every layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankShare {
    /// This rank (0 leads: it alone computes the output head).
    pub rank: usize,
    /// Ranks in the group.
    pub ranks: usize,
    /// The KV heads this rank holds.
    pub kv_heads: Range<usize>,
    /// The query heads this rank computes (those of its KV heads).
    pub heads: Range<usize>,
    /// The MLP's intermediate columns this rank computes.
    pub intermediate: Range<usize>,
    /// Each routed expert's intermediate columns this rank computes (every
    /// rank holds every expert's share; empty without experts).
    pub expert_intermediate: Range<usize>,
    /// The shared expert's columns this rank computes (empty without one).
    pub shared_intermediate: Range<usize>,
}

impl RankShare {
    /// Whether this rank leads its group.
    pub fn is_leader(&self) -> bool {
        self.rank == 0
    }
}

/// The shares of every rank of a group, in rank order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSplit {
    shares: Vec<RankShare>,
}

impl TensorSplit {
    /// `ranks` equal shares.
    pub fn even(config: &ModelConfig, ranks: usize) -> Result<Self> {
        Self::weighted(config, &vec![1.0; ranks])
    }

    /// Shares proportional to `weights`, one per rank.
    pub fn weighted(config: &ModelConfig, weights: &[f64]) -> Result<Self> {
        let ranks = weights.len();
        let bad = |m: String| Err(Error::Tensor(m));
        if ranks == 0 {
            return bad("a tensor group needs at least one rank".into());
        }
        if let Some(w) = weights.iter().find(|w| !(w.is_finite() && **w > 0.0)) {
            return bad(format!("rank weight {w} is not a positive number"));
        }
        if config.kv_heads == 0 || !config.heads.is_multiple_of(config.kv_heads) {
            return bad(format!(
                "{} query heads do not share {} KV heads evenly",
                config.heads, config.kv_heads
            ));
        }
        if ranks > config.kv_heads {
            return bad(format!(
                "{ranks} ranks need at least {ranks} KV heads (attention is split by whole KV \
                 heads); the model has {}",
                config.kv_heads
            ));
        }
        let intermediate = columns(config.intermediate_size, weights, "the MLP")?;
        let (experts, shared) = match &config.moe {
            Some(moe) => (
                columns(moe.expert_intermediate_size, weights, "each expert")?,
                match moe.shared_expert {
                    Some(width) => columns(width, weights, "the shared expert")?,
                    None => vec![0..0; ranks],
                },
            ),
            None => (vec![0..0; ranks], vec![0..0; ranks]),
        };
        let rep = config.heads / config.kv_heads;
        let groups = apportion(config.kv_heads, weights);
        let mut g = 0;
        let shares = (0..ranks)
            .map(|rank| {
                let kv_heads = g..g + groups[rank];
                g = kv_heads.end;
                RankShare {
                    rank,
                    ranks,
                    heads: kv_heads.start * rep..kv_heads.end * rep,
                    kv_heads,
                    intermediate: intermediate[rank].clone(),
                    expert_intermediate: experts[rank].clone(),
                    shared_intermediate: shared[rank].clone(),
                }
            })
            .collect();
        Ok(TensorSplit { shares })
    }

    /// The shares, in rank order.
    pub fn shares(&self) -> &[RankShare] {
        &self.shares
    }
}

/// `width` columns (of `what`) split in proportion to `weights`, in the
/// widest units [`column_unit`] allows.
fn columns(width: usize, weights: &[f64], what: &str) -> Result<Vec<Range<usize>>> {
    let ranks = weights.len();
    let unit = column_unit(width, ranks).ok_or_else(|| {
        Error::Tensor(format!(
            "{what}'s {width} columns cannot be split across {ranks} ranks"
        ))
    })?;
    let mut u = 0;
    Ok(apportion(width / unit, weights)
        .into_iter()
        .map(|n| {
            let range = u * unit..(u + n) * unit;
            u += n;
            range
        })
        .collect())
}

/// The widest unit of MLP columns (256: K-quant blocks; 32: Q8_0 and Q4
/// blocks; else single columns) that divides `columns` into at least
/// `ranks` units.
fn column_unit(columns: usize, ranks: usize) -> Option<usize> {
    [256, 32, 1]
        .into_iter()
        .find(|&unit| columns.is_multiple_of(unit) && columns / unit >= ranks)
}

/// Splits `total` units (at least one per weight) in proportion to
/// `weights`: floors first, then the largest remainders; ties go to the
/// lower rank.
fn apportion(total: usize, weights: &[f64]) -> Vec<usize> {
    let sum: f64 = weights.iter().sum();
    let ideal: Vec<f64> = weights.iter().map(|w| total as f64 * w / sum).collect();
    let mut counts: Vec<usize> = ideal.iter().map(|x| (x.floor() as usize).max(1)).collect();
    // Too many (every rank got at least one): take from the most over its ideal.
    while counts.iter().sum::<usize>() > total {
        let over = (0..counts.len())
            .filter(|&i| counts[i] > 1)
            .max_by(|&a, &b| {
                let (da, db) = (counts[a] as f64 - ideal[a], counts[b] as f64 - ideal[b]);
                da.total_cmp(&db).then(b.cmp(&a))
            })
            .expect("total is at least the number of ranks");
        counts[over] -= 1;
    }
    while counts.iter().sum::<usize>() < total {
        let under = (0..counts.len())
            .max_by(|&a, &b| {
                let (da, db) = (ideal[a] - counts[a] as f64, ideal[b] - counts[b] as f64);
                da.total_cmp(&db).then(b.cmp(&a))
            })
            .expect("at least one rank");
        counts[under] += 1;
    }
    counts
}

/// Parses rank weights written `2:1` (two ranks, the first twice the
/// second's share).
pub fn parse_weights(spec: &str) -> Result<Vec<f64>> {
    spec.split(':')
        .map(|part| {
            part.trim()
                .parse::<f64>()
                .ok()
                .filter(|w| w.is_finite() && *w > 0.0)
                .ok_or_else(|| {
                    Error::Tensor(format!(
                        "rank weights {spec:?}: {part:?} is not a positive number \
                         (write them like 2:1)"
                    ))
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Architecture;

    fn config(heads: usize, kv_heads: usize, intermediate: usize) -> ModelConfig {
        ModelConfig {
            architecture: Architecture::Llama,
            layers: 2,
            hidden_size: heads * 64,
            intermediate_size: intermediate,
            heads,
            kv_heads,
            head_dim: 64,
            vocab_size: 100,
            context_length: 128,
            rope_theta: 10000.0,
            rms_eps: 1e-5,
            attention_scale: 0.125,
            embedding_scale: 1.0,
            sliding: None,
            rope_scale: 1.0,
            yarn: None,
            rope_factors: None,
            moe: None,
            latent: None,
        }
    }

    #[test]
    fn three_ranks_take_one_kv_group_each() {
        let split = TensorSplit::even(&config(9, 3, 1536), 3).unwrap();
        let s = split.shares();
        assert_eq!(
            s.iter().map(|s| s.kv_heads.clone()).collect::<Vec<_>>(),
            [0..1, 1..2, 2..3]
        );
        assert_eq!(
            s.iter().map(|s| s.heads.clone()).collect::<Vec<_>>(),
            [0..3, 3..6, 6..9]
        );
        assert_eq!(
            s.iter().map(|s| s.intermediate.clone()).collect::<Vec<_>>(),
            [0..512, 512..1024, 1024..1536]
        );
    }

    #[test]
    fn two_ranks_split_three_groups_two_and_one() {
        let split = TensorSplit::even(&config(9, 3, 1536), 2).unwrap();
        let s = split.shares();
        assert_eq!(s[0].kv_heads, 0..2);
        assert_eq!(s[1].kv_heads, 2..3);
        assert_eq!(s[0].intermediate, 0..768);
        assert_eq!(s[1].intermediate, 768..1536);
        let uneven = TensorSplit::weighted(&config(9, 3, 1536), &[2.0, 1.0]).unwrap();
        assert_eq!(uneven.shares()[0].intermediate, 0..1024);
        assert_eq!(uneven.shares()[1].kv_heads, 2..3);
    }

    #[test]
    fn a_small_weight_still_gets_one_unit() {
        let split = TensorSplit::weighted(&config(8, 4, 1024), &[100.0, 1.0]).unwrap();
        let s = split.shares();
        assert_eq!(s[0].kv_heads, 0..3);
        assert_eq!(s[1].kv_heads, 3..4);
        assert_eq!(s[1].intermediate, 768..1024);
    }

    #[test]
    fn impossible_splits_say_why() {
        let e = TensorSplit::even(&config(9, 3, 1536), 4).unwrap_err();
        assert!(e.to_string().contains("at least 4 KV heads"), "{e}");
        let e = TensorSplit::weighted(&config(9, 3, 1536), &[1.0, 0.0]).unwrap_err();
        assert!(e.to_string().contains("positive"), "{e}");
        assert!(parse_weights("2:x").is_err());
        assert_eq!(parse_weights("2:1").unwrap(), [2.0, 1.0]);
    }

    #[test]
    fn experts_and_a_shared_expert_are_split_by_their_own_columns() {
        let mut c = config(8, 4, 1024);
        c.moe = Some(crate::config::Moe {
            experts: 8,
            experts_per_token: 2,
            expert_intermediate_size: 96,
            normalize: true,
            dense_layers: vec![0],
            shared_expert: Some(64),
            shared_gate: true,
            bias: false,
            routing: crate::config::Routing::Softmax,
        });
        let split = TensorSplit::weighted(&c, &[2.0, 1.0]).unwrap();
        let s = split.shares();
        // 96 = 3 units of 32: two and one; 64 = 2 units: one each.
        assert_eq!(
            (
                s[0].expert_intermediate.clone(),
                s[1].expert_intermediate.clone()
            ),
            (0..64, 64..96)
        );
        assert_eq!(
            (
                s[0].shared_intermediate.clone(),
                s[1].shared_intermediate.clone()
            ),
            (0..32, 32..64)
        );
        // The dense layer keeps the MLP's own split.
        assert_eq!(s[1].intermediate, 768..1024);
        // Three ranks: 96 in units of 32, 64 column by column.
        let three = TensorSplit::even(&c, 3).unwrap();
        let s = three.shares();
        assert_eq!(s[1].expert_intermediate, 32..64);
        assert_eq!(
            (
                s[0].shared_intermediate.clone(),
                s[2].shared_intermediate.end
            ),
            (0..22, 64)
        );
    }

    #[test]
    fn shares_cover_everything_once() {
        for ranks in 1..=4 {
            for weights in [vec![1.0; ranks], (1..=ranks).map(|r| r as f64).collect()] {
                let split = TensorSplit::weighted(&config(16, 4, 1000), &weights).unwrap();
                let s = split.shares();
                assert_eq!(s[0].kv_heads.start, 0);
                assert_eq!(s[ranks - 1].kv_heads.end, 4);
                assert_eq!(s[ranks - 1].intermediate.end, 1000);
                for pair in s.windows(2) {
                    assert_eq!(pair[0].kv_heads.end, pair[1].kv_heads.start);
                    assert_eq!(pair[0].intermediate.end, pair[1].intermediate.start);
                    assert!(!pair[1].kv_heads.is_empty() && !pair[1].intermediate.is_empty());
                }
            }
        }
    }
}
