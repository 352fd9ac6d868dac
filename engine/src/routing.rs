//! DeepSeek V3's expert choice (sigmoid scores within the best groups),
//! computed on the host from a row of router logits by both engines.
//!
//! ```text
//!  logits ─► sigmoid ─► + choice bias ─► group score: sum of its best two
//!        ─► keep the best groups ─► top k on the biased scores
//!        ─► weights: the unbiased scores (renormalised) × scale
//! ```

/// DeepSeek V3's choice for a row of router logits: sigmoid scores; each
/// of `groups` equal groups scored by the sum of its two best biased
/// scores; the experts of the `top_groups` best groups compete on their
/// biased scores (the others count as 0, as the reference zeroes them);
/// the `k` best are weighted by their unbiased scores, renormalised when
/// asked, times `scale`. Ties go to the lower index.
pub(crate) fn route_groups(
    logits: &[f32],
    bias: &[f32],
    (groups, top_groups): (usize, usize),
    k: usize,
    normalize: bool,
    scale: f32,
) -> Vec<(usize, f32)> {
    let scores: Vec<f32> = logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect();
    let mut choice: Vec<f32> = scores
        .iter()
        .enumerate()
        .map(|(e, s)| s + bias.get(e).copied().unwrap_or(0.0))
        .collect();
    let per_group = choice.len() / groups.max(1);
    if groups > 1 && per_group > 0 {
        let group_score = |g: usize| {
            let mut members: Vec<f32> = choice[g * per_group..(g + 1) * per_group].to_vec();
            members.sort_by(|a, b| b.total_cmp(a));
            members.iter().take(2).sum::<f32>()
        };
        let mut order: Vec<(usize, f32)> = (0..groups).map(|g| (g, group_score(g))).collect();
        order.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        for &(g, _) in &order[top_groups.min(groups)..] {
            choice[g * per_group..(g + 1) * per_group].fill(0.0);
        }
    }
    let mut order: Vec<usize> = (0..choice.len()).collect();
    order.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]).then(a.cmp(&b)));
    order.truncate(k);
    let sum: f32 = order.iter().map(|&e| scores[e]).sum();
    let divisor = if normalize && k > 1 { sum } else { 1.0 };
    order
        .into_iter()
        .map(|e| (e, scores[e] / divisor * scale))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::route_groups;

    #[test]
    fn group_routing_chooses_within_the_best_groups_and_weighs_by_the_unbiased_scores() {
        let sigmoid = |x: f32| 1.0 / (1.0 + (-x).exp());
        // Eight experts in four groups of two; two groups per token.
        let logits = [3.0, -3.0, 0.5, 0.4, 2.9, -2.0, 0.0, 0.1f32];
        // The bias lifts expert 7, so group 3 (6, 7: 0.50 + 0.52 + 0.6)
        // and group 1 (2, 3: 0.62 + 0.60) beat group 0 (0.95 + 0.05) and
        // group 2 (0.95 + 0.12): experts 0 and 4, the best scores, are out.
        let bias = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.6f32];
        let r = route_groups(&logits, &bias, (4, 2), 2, true, 2.5);
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![7, 2]);
        // Weighed by the scores without the bias.
        let (a, b) = (sigmoid(0.1), sigmoid(0.5));
        assert!((r[0].1 - a / (a + b) * 2.5).abs() < 1e-6, "{r:?}");
        assert!((r[1].1 - b / (a + b) * 2.5).abs() < 1e-6, "{r:?}");
        // One group per token keeps the choice inside the best (group 1
        // without the bias); unnormalised weights are the scores times the
        // scale.
        let r = route_groups(&logits, &[0.0; 8], (4, 1), 2, false, 1.0);
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![2, 3]);
        assert!((r[1].1 - sigmoid(0.4)).abs() < 1e-6);
    }
}
