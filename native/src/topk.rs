//! What a decision showing its best `top_k` rows may leave out (`route::Prune`, asked by
//! `route::route_cohort` for each touched member, the highest bounds first): the rank those rows
//! reach so far, and a row's score as `decide.rs` ranks it.

use crate::decide::{round9, tier, CohortPlan, Live, CPU_W, OVERLAP_W};
use crate::route::{NodeOut, Prune};

/// The rank a decision's shown rows reach: the `k` best (tier, score) among the nodes worked out
/// with a hit, best first. A member is left out when even its bound cannot beat the `k`-th: it
/// would rank below `k` rows with a hit, so it is neither the chosen row nor shown (and those rows'
/// positive scores keep every node holding nothing out, as they would have).
pub(crate) struct Bar {
    pub(crate) k: usize,
    pub(crate) best: Vec<(u8, f64)>,
}

/// `Bar` for one cohort's members.
pub(crate) struct CohortBar<'a> {
    pub(crate) bar: &'a mut Bar,
    pub(crate) cohort: &'a CohortPlan,
    pub(crate) live: &'a [Live],
    pub(crate) now: f64,
    pub(crate) stale: Option<&'a (f64, String)>,
    pub(crate) cap: f64,
}

impl CohortBar<'_> {
    fn rank(&self, member: usize, gpu: i64, loadable: i64) -> (u8, f64) {
        let l = &self.live[self.cohort.nodes[member]];
        (
            tier(l, self.now, self.stale),
            score(gpu, loadable, self.cap, l),
        )
    }
}

impl Prune for CohortBar<'_> {
    fn skip(&mut self, member: usize, gpu: i64, any: i64) -> bool {
        let Some(&(t, s)) = self.bar.best.get(self.bar.k - 1) else {
            return false;
        };
        // the best the member could do: both bounds reached (the score grows with each)
        let gpu = gpu.min(any);
        let (mt, ms) = self.rank(member, gpu, any - gpu);
        t < mt || (t == mt && s > ms)
    }

    fn seen(&mut self, node: &NodeOut) {
        let loadable = node.any_tokens - node.gpu_tokens;
        if node.gpu_tokens <= 0 && loadable <= 0 {
            return;
        }
        let r = self.rank(node.member, node.gpu_tokens, loadable);
        let best = &mut self.bar.best;
        let at = best.partition_point(|&(t, s)| t < r.0 || (t == r.0 && s >= r.1));
        if at < self.bar.k {
            best.insert(at, r);
            best.truncate(self.bar.k);
        }
    }
}

/// A row's score (`processors/router/rows.py: score` with the default weights, nothing in flight).
pub(crate) fn score(gpu: i64, loadable: i64, cap: f64, l: &Live) -> f64 {
    round9(OVERLAP_W * (gpu as f64 + CPU_W * loadable as f64) / cap - l.penalty)
}
