//! Group-limited expert choice, computed on the host from a row of router
//! logits by both engines: DeepSeek V3's (sigmoid scores, a choice bias,
//! groups scored by their best two) and DeepSeek V2's (softmax scores,
//! groups scored by their best one; one group: plain top k).
//!
//! ```text
//!  logits ─► sigmoid (V3) │ softmax (V2) ─► + choice bias (V3)
//!        ─► group score: sum of its best two (V3) │ its best (V2)
//!        ─► keep the best groups ─► top k on the (biased) scores
//!        ─► weights: the unbiased scores (renormalised when asked) × scale
//! ```

use crate::config::Routing;

/// The choice of `routing` for a row of router logits: each of the groups
/// scored; the experts of the best groups compete on their scores plus
/// `bias` (the others count as 0, as the references zero them); the `k`
/// best are weighted by their scores without the bias, renormalised when
/// asked, times the routing's scale. Ties go to the lower index. Plain
/// softmax routing is one group of all with a scale of 1.
pub(crate) fn route_groups(
    logits: &[f32],
    bias: &[f32],
    routing: Routing,
    k: usize,
    normalize: bool,
) -> Vec<(usize, f32)> {
    let (groups, top_groups, scale) = routing.groups();
    let sigmoid = matches!(routing, Routing::SigmoidGroups { .. });
    let scores: Vec<f32> = if sigmoid {
        logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect()
    } else {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let exps: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
        let sum: f32 = exps.iter().sum();
        exps.iter().map(|e| e / sum).collect()
    };
    let mut choice: Vec<f32> = scores
        .iter()
        .enumerate()
        .map(|(e, s)| s + bias.get(e).copied().unwrap_or(0.0))
        .collect();
    let per_group = choice.len() / groups.max(1);
    let best = if sigmoid { 2 } else { 1 };
    if groups > 1 && per_group > 0 {
        let group_score = |g: usize| {
            let mut members: Vec<f32> = choice[g * per_group..(g + 1) * per_group].to_vec();
            members.sort_by(|a, b| b.total_cmp(a));
            members.iter().take(best).sum::<f32>()
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
    use crate::config::Routing;

    fn v3(groups: usize, top_groups: usize, scale: f32) -> Routing {
        Routing::SigmoidGroups {
            groups,
            top_groups,
            scale,
        }
    }

    #[test]
    fn group_routing_chooses_within_the_best_groups_and_weighs_by_the_unbiased_scores() {
        let sigmoid = |x: f32| 1.0 / (1.0 + (-x).exp());
        // Eight experts in four groups of two; two groups per token.
        let logits = [3.0, -3.0, 0.5, 0.4, 2.9, -2.0, 0.0, 0.1f32];
        // The bias lifts expert 7, so group 3 (6, 7: 0.50 + 0.52 + 0.6)
        // and group 1 (2, 3: 0.62 + 0.60) beat group 0 (0.95 + 0.05) and
        // group 2 (0.95 + 0.12): experts 0 and 4, the best scores, are out.
        let bias = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.6f32];
        let r = route_groups(&logits, &bias, v3(4, 2, 2.5), 2, true);
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![7, 2]);
        // Weighed by the scores without the bias.
        let (a, b) = (sigmoid(0.1), sigmoid(0.5));
        assert!((r[0].1 - a / (a + b) * 2.5).abs() < 1e-6, "{r:?}");
        assert!((r[1].1 - b / (a + b) * 2.5).abs() < 1e-6, "{r:?}");
        // One group per token keeps the choice inside the best (group 1
        // without the bias); unnormalised weights are the scores times the
        // scale.
        let r = route_groups(&logits, &[0.0; 8], v3(4, 1, 1.0), 2, false);
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![2, 3]);
        assert!((r[1].1 - sigmoid(0.4)).abs() < 1e-6);
    }

    #[test]
    fn softmax_routing_chooses_within_the_groups_of_the_best_experts() {
        let logits = [3.0, -3.0, 0.5, 0.4, 2.9, -2.0, 0.0, 0.1f32];
        let sum: f32 = logits.iter().map(|l| l.exp()).sum();
        let p = |e: usize| logits[e].exp() / sum;
        // One group: plain top 2, the softmax scores times the scale.
        let greedy = Routing::SoftmaxGroups {
            groups: 1,
            top_groups: 1,
            scale: 2.0,
        };
        let r = route_groups(&logits, &[], greedy, 2, false);
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 4]);
        assert!((r[0].1 - 2.0 * p(0)).abs() < 1e-6, "{r:?}");
        // Four groups of two scored by their best: groups 0 (3.0) and 2
        // (2.9) lead; with one group allowed, expert 1 (group 0's other)
        // beats expert 4, however low its score.
        let one_group = Routing::SoftmaxGroups {
            groups: 4,
            top_groups: 1,
            scale: 1.0,
        };
        let r = route_groups(&logits, &[], one_group, 2, true);
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 1]);
        assert!((r[0].1 - p(0) / (p(0) + p(1))).abs() < 1e-6, "{r:?}");
        // A group is its best expert, not its best two: group 0 (0.30,
        // 0.01) beats group 1 (0.25, 0.24), which the sum of two would
        // choose.
        let logits = [0.30f32.ln(), 0.01f32.ln(), 0.25f32.ln(), 0.24f32.ln()];
        let halves = Routing::SoftmaxGroups {
            groups: 2,
            top_groups: 1,
            scale: 1.0,
        };
        let r = route_groups(&logits, &[], halves, 2, false);
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 1]);
        let r = route_groups(&logits, &[], v3(2, 1, 1.0), 2, false);
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![2, 3]);
    }
}
