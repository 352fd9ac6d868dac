//! Ordering the stages of an instance around the ring so that the measured
//! link cost of one token's round (stage to stage, and last back to first)
//! is smallest.

use crate::cluster::Cluster;

/// Exhaustive search up to this many nodes ((n-1)! = 720 orders); beyond,
/// nearest neighbour from the first node.
const EXHAUSTIVE_UP_TO: usize = 7;

/// The cost of one round of `order`, in microseconds (see `Cluster::hop_cost`).
pub(crate) fn ring_cost(cluster: &Cluster, order: &[&str]) -> u64 {
    if order.len() < 2 {
        return 0;
    }
    let hops: u64 = order.windows(2).map(|w| cluster.hop_cost(w[0], w[1])).sum();
    hops + cluster.hop_cost(order[order.len() - 1], order[0])
}

/// Orders `nodes` (the first stays first: it is the preferred head) to
/// minimise the ring's cost; ties keep the given order.
pub(crate) fn order_ring<'a>(cluster: &Cluster, nodes: &[&'a str]) -> Vec<&'a str> {
    if nodes.len() <= 2 {
        return nodes.to_vec();
    }
    if nodes.len() <= EXHAUSTIVE_UP_TO {
        let mut best = nodes.to_vec();
        let mut best_cost = ring_cost(cluster, &best);
        let mut rest: Vec<&str> = nodes[1..].to_vec();
        permute(&mut rest, 0, &mut |perm| {
            let mut candidate = Vec::with_capacity(nodes.len());
            candidate.push(nodes[0]);
            candidate.extend_from_slice(perm);
            let cost = ring_cost(cluster, &candidate);
            if cost < best_cost {
                best_cost = cost;
                best = candidate;
            }
        });
        return best;
    }
    let mut order = vec![nodes[0]];
    let mut left: Vec<&str> = nodes[1..].to_vec();
    while !left.is_empty() {
        let last = order[order.len() - 1];
        let (i, _) = left
            .iter()
            .enumerate()
            .min_by_key(|(i, n)| (cluster.hop_cost(last, n), *i))
            .expect("nodes left");
        order.push(left.remove(i));
    }
    order
}

fn permute<'a>(items: &mut [&'a str], k: usize, visit: &mut impl FnMut(&[&'a str])) {
    if k == items.len() {
        visit(items);
        return;
    }
    for i in k..items.len() {
        items.swap(k, i);
        permute(items, k + 1, visit);
        items.swap(k, i);
    }
}
