//! The CPU tier's copies per node, epoch, group and hash: the native twin of
//! processors/analytics/cputier.py's `CpuTier` (its module doc holds the rule and its invariants).
//! `CapacityCore` exposes it per message and event (`cpu_message`, `cpu_gpu_store`, `cpu_add`).

use foldhash::fast::RandomState;
use hashbrown::{HashMap, HashSet};

/// block hash → CPU copies (never 0: a count back at 0 is dropped, absent = 0; negative ones stay)
pub type Counts = HashMap<u64, i64, RandomState>;

/// One node's counts in its latest applied epoch (cputier.py `NodeCopies`).
pub struct NodeCopies {
    pub epoch: i64,
    pub partition: i64,
    /// per group (-1: none), the few a node has, scanned
    pub groups: Vec<(i64, Counts)>,
}

impl NodeCopies {
    fn new(epoch: i64, partition: i64) -> Self {
        Self {
            epoch,
            partition,
            groups: Vec::new(),
        }
    }

    fn group(&self, group: i64) -> Option<&Counts> {
        self.groups
            .iter()
            .find(|(g, _)| *g == group)
            .map(|(_, c)| c)
    }

    fn group_mut(&mut self, group: i64) -> &mut Counts {
        let i = match self.groups.iter().position(|(g, _)| *g == group) {
            Some(i) => i,
            None => {
                self.groups.push((group, Counts::default()));
                self.groups.len() - 1
            }
        };
        &mut self.groups[i].1
    }
}

#[derive(Default)]
pub struct CpuTier {
    pub(super) nodes: HashMap<String, NodeCopies, RandomState>,
    /// partitions whose counts were dropped and not installed again: their events get None
    pub(super) unknown: HashSet<i64, RandomState>,
}

impl CpuTier {
    pub fn message(&mut self, node: &str, epoch: i64, partition: i64) -> bool {
        if self.unknown.contains(&partition) {
            return false;
        }
        match self.nodes.get_mut(node) {
            // a new epoch is a new cache: its counts start empty
            Some(copies) if copies.epoch != epoch => *copies = NodeCopies::new(epoch, partition),
            Some(copies) => copies.partition = partition,
            None => {
                self.nodes
                    .insert(node.to_owned(), NodeCopies::new(epoch, partition));
            }
        }
        true
    }

    pub fn gpu_store(&self, node: &str, group: i64, hashes: &[u64]) -> u32 {
        let Some(held) = self.nodes.get(node).and_then(|n| n.group(group)) else {
            return 0;
        };
        if held.is_empty() {
            return 0;
        }
        hashes
            .iter()
            .filter(|&h| held.get(h).is_some_and(|&n| n > 0))
            .count() as u32
    }

    pub fn add(&mut self, node: &str, group: i64, hashes: &[u64], step: i64) {
        let Some(copies) = self.nodes.get_mut(node) else {
            return; // no `message` for this node: never the case for an applied message
        };
        let held = copies.group_mut(group);
        for &h in hashes {
            let n = held.get(&h).copied().unwrap_or(0) + step;
            if n != 0 {
                held.insert(h, n);
            } else {
                held.remove(&h);
            }
        }
    }

    pub fn forget_partition(&mut self, partition: i64) {
        self.nodes.retain(|_, n| n.partition != partition);
        self.unknown.insert(partition);
    }

    /// One node's counts as rebuilt elsewhere (cputier.py `build_nodes`), replacing what it had.
    pub fn install_node(&mut self, node: &str, epoch: i64, partition: i64) {
        self.nodes
            .insert(node.to_owned(), NodeCopies::new(epoch, partition));
    }

    pub fn install_counts(copies: &mut NodeCopies, group: i64, hashes: &[u64], counts: &[i64]) {
        let held = copies.group_mut(group);
        for (&h, &n) in hashes.iter().zip(counts) {
            if n != 0 {
                held.insert(h, n);
            } else {
                held.remove(&h);
            }
        }
    }

    pub fn entries(&self) -> usize {
        self.nodes
            .values()
            .flat_map(|n| &n.groups)
            .map(|(_, c)| c.len())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::captrack::Rng;

    #[test]
    fn counts_equal_a_walk_over_random_events() {
        for seed in 0..30 {
            let mut rng = Rng(seed);
            let mut tier = CpuTier::default();
            // the walk: (node, epoch, group, hash) → CPU stores minus removals, and each node's epoch
            let mut walk: std::collections::HashMap<(u64, i64, i64, u64), i64> = Default::default();
            let mut epochs: std::collections::HashMap<u64, i64> = Default::default();
            for _ in 0..400 {
                let node = rng.below(3);
                let name = format!("n{node}");
                let epoch = *epochs.entry(node).or_insert(1) + (rng.below(20) == 0) as i64;
                epochs.insert(node, epoch);
                assert!(tier.message(&name, epoch, 0));
                for _ in 0..rng.below(5) {
                    let group = rng.below(3) as i64 - 1;
                    let hashes: Vec<u64> = (0..rng.below(6)).map(|_| rng.below(8)).collect();
                    match rng.below(3) {
                        0 => {
                            let want = hashes
                                .iter()
                                .filter(|&&h| {
                                    walk.get(&(node, epoch, group, h)).is_some_and(|&n| n > 0)
                                })
                                .count() as u32;
                            assert_eq!(tier.gpu_store(&name, group, &hashes), want, "seed {seed}");
                        }
                        kind => {
                            let step = if kind == 1 { 1 } else { -1 };
                            tier.add(&name, group, &hashes, step);
                            for &h in &hashes {
                                *walk.entry((node, epoch, group, h)).or_insert(0) += step;
                            }
                        }
                    }
                }
            }
            let live = walk
                .iter()
                .filter(|(k, &n)| n != 0 && epochs[&k.0] == k.1)
                .count();
            assert_eq!(tier.entries(), live, "seed {seed}");
        }
    }

    #[test]
    fn a_forgotten_partition_is_unknown_until_installed_and_keeps_the_others() {
        let mut tier = CpuTier::default();
        tier.message("a", 1, 0);
        tier.add("a", 0, &[4], 1);
        tier.message("b", 1, 1);
        tier.add("b", 0, &[6], 1);
        tier.forget_partition(0);
        assert!(!tier.message("a", 1, 0));
        assert!(tier.message("b", 1, 1) && tier.gpu_store("b", 0, &[6, 6, 7]) == 2);
        tier.install_node("a", 1, 0);
        CpuTier::install_counts(tier.nodes.get_mut("a").unwrap(), 0, &[4, 5], &[1, -1]);
        tier.unknown.remove(&0);
        assert!(tier.message("a", 1, 0));
        assert_eq!(tier.gpu_store("a", 0, &[4, 5]), 1);
        tier.add("a", 0, &[5], 1); // back to 0: dropped
        assert_eq!(tier.entries(), 2);
    }
}
