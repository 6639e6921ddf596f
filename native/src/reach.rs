//! How much of a prompt's chain the native route decision needs (`decide.rs`): up to the first
//! full-attention block no node holds.
//!
//! Why that is enough: vLLM's hybrid search (`hit::find_hit`, `gpu/hit.py`) takes the full-attention
//! group first, and the other groups only shorten the hit from there, so a node's hit never passes
//! its full-attention prefix. Where block `j` of a full-attention group is held by no slot at all,
//! no node of the layout can hit past `j` blocks, and every other group's rules (a sliding window
//! before the hit, the Mamba state at it, the chunk it ends in) only read blocks before the hit. So
//! hashing stops after that block, and the search walks no position after it. An uncached prompt
//! costs one unit's hash instead of the whole chain; a cached one stops just past its held prefix.
//!
//! Where this does not hold, nothing is cut: a layout without a full-attention group searched per
//! block, EAGLE layouts (their drop looks one block past the hit), and the prefix-per-group
//! semantics. That one reports, per group, every medium a node holds the group on anywhere in the
//! prompt (0 where only later blocks are there), so a block held past any cut shows in its answer
//! (`tests/unit/router/test_router_native_reach.py` holds such a node).

use crate::decide::Plan;
use crate::hit::{is_fine_grained, Kind};
use crate::store::Store;

/// The full-attention views that bound the hits of one hash configuration's nodes: per distinct
/// (group id, units per block), the key of the block nobody held that ended it, once seen.
pub struct Reach {
    views: Vec<(u64, usize)>,
    ended: Vec<Option<u64>>,
}

impl Reach {
    /// The bound for configuration `config` of `plan`, or None where some node's layout has none.
    pub fn of(plan: &Plan, config: usize) -> Option<Reach> {
        let unit = plan.configs.get(config)?.unit;
        let mut views: Vec<(u64, usize)> = Vec::new();
        for c in plan.cohorts.iter().filter(|c| c.config == config) {
            for m in &c.models {
                let layout = plan.layouts.get(m.layout)?;
                if layout.spec_groups.iter().any(|sg| sg.eagle) {
                    return None;
                }
                let sg = layout.spec_groups.iter().find(|sg| {
                    sg.kind == Kind::Full && !is_fine_grained(sg.block_size, layout.alignment)
                })?;
                let &(group, block_size) = c.groups.get(*sg.members.first()?)?;
                if unit == 0 || block_size as i64 != sg.block_size || block_size % unit != 0 {
                    return None;
                }
                let view = (group, block_size / unit);
                if view.1 == 0 {
                    return None;
                }
                if !views.contains(&view) {
                    views.push(view);
                }
            }
        }
        if views.is_empty() {
            return None;
        }
        let ended = vec![None; views.len()];
        Some(Reach { views, ended })
    }

    /// Told the key of unit `i` (0-based) of the chain: whether any unit after it may be needed.
    /// `holds(group, key)`: whether any slot holds the block (the caller says under which lock).
    pub fn more(&mut self, holds: &mut dyn FnMut(u64, u64) -> bool, i: usize, key: u64) -> bool {
        for (w, &(group, per_block)) in self.views.iter().enumerate() {
            if self.ended[w].is_none() && (i + 1).is_multiple_of(per_block) && !holds(group, key) {
                self.ended[w] = Some(key);
            }
        }
        self.ended.iter().any(|e| e.is_none())
    }

    /// Whether the blocks that ended the chain are still held by no slot of `store` (a chain
    /// hashed under other locks than the search's is checked again under the search's).
    pub fn unheld(&self, store: &Store) -> bool {
        self.views
            .iter()
            .zip(&self.ended)
            .all(|(&(group, _), e)| e.is_none_or(|key| !store.holds_any(group, key)))
    }

    /// Forget what ended the chain, to walk it again.
    pub fn reset(&mut self) {
        self.ended.iter_mut().for_each(|e| *e = None);
    }

    /// How many leading keys of a given chain are needed. Any block nobody holds bounds the hits, not
    /// only the first, so a bisection finds one in a few lookups: the last block (a prompt ends in
    /// fresh tokens more often than not), then between the held and the unheld block found so far.
    /// A chain whose last block some slot holds is not cut.
    pub fn cut(&self, store: &Store, keys: &[u64]) -> usize {
        let mut need = 0;
        for &(group, per_block) in &self.views {
            let blocks = keys.len() / per_block;
            let held = |j: usize| store.holds_any(group, keys[(j + 1) * per_block - 1]);
            let Some(hi) = unheld_block(blocks, held) else {
                return keys.len();
            };
            need = need.max((hi + 1) * per_block);
        }
        need.min(keys.len())
    }

    /// `cut` for a request that sends each group's blocks (`lists`: group, its block keys), in tokens
    /// of a prompt hashed in `unit`-token units: every list may end after that many tokens. None where
    /// nothing is cut (a bounding group without a list, or whose last block some slot holds).
    pub fn cut_blocks(&self, store: &Store, lists: &[(u64, &[u64])], unit: usize) -> Option<usize> {
        let mut need = 0;
        for &(group, per_block) in &self.views {
            let (_, keys) = lists.iter().find(|(g, _)| *g == group)?;
            let hi = unheld_block(keys.len(), |j| store.holds_any(group, keys[j]))?;
            need = need.max((hi + 1) * per_block * unit);
        }
        Some(need)
    }
}

/// A block of `blocks` that `held` says no slot holds, found by bisection (the last one first: a
/// prompt ends in fresh tokens more often than not); None when the last block is held or there is
/// none.
fn unheld_block(blocks: usize, held: impl Fn(usize) -> bool) -> Option<usize> {
    if blocks == 0 || held(blocks - 1) {
        return None;
    }
    // block `hi` is held by no slot; blocks up to `lo` (exclusive of -1: none yet) were
    let (mut lo, mut hi) = (None::<usize>, blocks - 1);
    while lo.map_or(0, |l| l + 1) < hi {
        let from = lo.map_or(0, |l| l + 1);
        let mid = from + (hi - from) / 2;
        if held(mid) {
            lo = Some(mid);
        } else {
            hi = mid;
        }
    }
    Some(hi)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::SlotMeta;

    /// A store whose group 0 holds the keys `100 + i` for the blocks `held`.
    fn store_holding(held: &[u64]) -> Store {
        let mut s = Store::new();
        let slot = s.new_slot(0, SlotMeta::default()).unwrap();
        let keys: Vec<u64> = held.iter().map(|&i| 100 + i).collect();
        s.store(slot, &keys, 1.0, None).unwrap();
        s
    }

    fn reach(per_block: usize) -> Reach {
        Reach {
            views: vec![(0, per_block)],
            ended: vec![None],
        }
    }

    /// Every cut ends on a block no slot holds, or keeps the whole chain when its last block is held.
    #[test]
    fn a_cut_ends_on_a_block_nobody_holds() {
        let mut next = crate::testrng::xorshift(0x5eed_cafe);
        for round in 0..2_000 {
            let per_block = 1 + (next() % 3) as usize;
            let blocks = (next() % 40) as usize;
            let held: Vec<u64> = (0..blocks as u64)
                .filter(|_| !next().is_multiple_of(4))
                .collect();
            let s = store_holding(&held);
            // unit i's key: the block key at each block's last unit, a key nobody holds elsewhere
            let keys: Vec<u64> = (0..blocks * per_block)
                .map(|i| {
                    if (i + 1) % per_block == 0 {
                        100 + ((i + 1) / per_block - 1) as u64
                    } else {
                        1 << 40
                    }
                })
                .collect();
            let cut = reach(per_block).cut(&s, &keys);
            // the same prompt as its block list: the same bound, in tokens (16 per unit here)
            let block_keys: Vec<u64> = (0..blocks as u64).map(|b| 100 + b).collect();
            let in_tokens = reach(per_block).cut_blocks(&s, &[(0, &block_keys[..])], 16);
            let last_held = blocks > 0 && held.contains(&(blocks as u64 - 1));
            if blocks == 0 || last_held {
                assert_eq!(in_tokens, None, "round {round}");
            } else {
                assert_eq!(in_tokens, Some(cut * 16), "round {round}");
            }
            let other = reach(per_block).cut_blocks(&s, &[(1, &[100][..])], 16);
            assert_eq!(other, None, "a bounding group without a list cuts nothing");
            if blocks == 0 || last_held {
                assert_eq!(cut, keys.len(), "round {round}");
            } else {
                assert_eq!(cut % per_block, 0, "round {round}");
                let block = (cut / per_block - 1) as u64;
                assert!(
                    !held.contains(&block),
                    "round {round}: block {block} is held"
                );
            }
            // unit by unit: the chain stops right after the first block nobody holds
            let mut r = reach(per_block);
            let mut holds = |g, k| s.holds_any(g, k);
            let stop = (0..keys.len()).find(|&i| !r.more(&mut holds, i, keys[i]));
            let first_unheld = (0..blocks as u64).find(|b| !held.contains(b));
            assert_eq!(
                stop,
                first_unheld.map(|b| (b as usize + 1) * per_block - 1),
                "round {round}"
            );
            assert!(r.unheld(&s), "round {round}");
            // the block that ended the chain stored meanwhile: the cut no longer holds
            if let Some(b) = first_unheld {
                let mut s = s;
                let slot = s.new_slot(0, SlotMeta::default()).unwrap();
                s.store(slot, &[100 + b], 1.0, None).unwrap();
                assert!(!r.unheld(&s), "round {round}");
                r.reset();
                let mut holds = |g, k| s.holds_any(g, k);
                let again = (0..keys.len()).find(|&i| !r.more(&mut holds, i, keys[i]));
                assert!(again.is_none_or(|i| i > stop.unwrap()), "round {round}");
            }
        }
    }
}
