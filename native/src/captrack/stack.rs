//! One slot's LRU stack of stores, with the end of each remembered hash's last lifetime: the native
//! twin of processors/analytics/stackdist.py (`StackDistance`) together with the `ended` dict of
//! processors/analytics/restores.py's `Slot`.
//!
//! Times and bound are Python's, access for access: each access takes the next time; when the time
//! reaches `size`, the live keys are compacted to times 0..n-1 in time order, the least recent past
//! `max_keys` forgotten, and `size = max(16, 2n)` (4096 for a new stack). A forgotten key's next
//! access is a first one. So the same accesses forget the same keys at the same moments, and every
//! distance is the same, not only those below the bound.
//!
//! Counting: a bit per time marks each live key's latest time, with a Fenwick tree over 64-bit words
//! of them. All marks are before the current time, so the distance of an access to a key last seen
//! at p (the live keys after p) is `len - prefix(p)`: O(log size) per access. A compaction is one
//! pass over the keys, each getting its rank among the marks as its new time (amortised O(1)).
//!
//! A key's end lives in its entry, not in a second map as Python's `ended`: one probe per stored hash
//! finds both, and the end goes when the stack forgets the key. Python keeps such ends until
//! `Slot.prune`; that changes no output, since a key the stack forgot before a `_stored` call is a
//! first access there and counts in `held` with or without an end. Only within the call whose
//! compaction forgot it does Python still see its end: `CapacityCore::stored` reads what it needs
//! of the keys before compacting.

use foldhash::fast::RandomState;
use hashbrown::hash_map::Entry as MapEntry;
use hashbrown::HashMap;

/// `Entry::reason` of a key whose lifetime did not end since its latest store.
pub const NO_END: u32 = u32::MAX;

/// A new stack's size (stackdist.py's `initial_size`) and the least one after a compaction.
const INITIAL_SIZE: usize = 1 << 12;
const MIN_SIZE: usize = 16;

/// A remembered key: the time of its latest access and, when its lifetime ended since, when and why
/// (`reason`: an id `CapacityCore` interns; `NO_END` when none).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Entry {
    pub t: u32,
    pub reason: u32,
    pub removed_ts: f64,
}

impl Entry {
    /// The end, taken (Python's `ended.pop`).
    pub fn take_end(&mut self) -> Option<(f64, u32)> {
        if self.reason == NO_END {
            return None;
        }
        let reason = std::mem::replace(&mut self.reason, NO_END);
        Some((self.removed_ts, reason))
    }
}

pub type Keys = HashMap<u64, Entry, RandomState>;

/// Which times are a live key's latest: one bit per time, and a Fenwick tree over the 64-time words
/// (a tree 64 times smaller than one over times: it stays in cache, 6 levels fewer per access).
struct Marks {
    bits: Vec<u64>,
    /// 1-based: node i holds the set bits of words (i - lowbit(i), i]
    tree: Vec<u32>,
}

impl Marks {
    /// Over `size` times, the first `n` set.
    fn with_prefix(size: usize, n: usize) -> Self {
        let mut marks = Self {
            bits: Vec::new(),
            tree: Vec::new(),
        };
        marks.reset(size, n);
        marks
    }

    /// `with_prefix` in the vectors already there (a compaction: no new pages to fault in).
    fn reset(&mut self, size: usize, n: usize) {
        let words = size.div_ceil(64).max(1);
        let ones_below = |w: usize| (w * 64).min(n); // set times in words 0..w
        self.bits.clear();
        self.bits
            .extend((0..words).map(|w| match ones_below(w + 1) - ones_below(w) {
                64 => u64::MAX,
                k => (1u64 << k) - 1,
            }));
        self.tree.clear();
        self.tree.extend(
            (0..=words).map(|i| (ones_below(i) - ones_below(i - (i & i.wrapping_neg()))) as u32),
        );
    }

    fn add(&mut self, word: usize, delta: u32) {
        let mut i = word + 1;
        while i < self.tree.len() {
            self.tree[i] = self.tree[i].wrapping_add(delta);
            i += i & i.wrapping_neg();
        }
    }

    fn set(&mut self, at: usize) {
        self.bits[at >> 6] |= 1 << (at & 63);
        self.add(at >> 6, 1);
    }

    fn unset(&mut self, at: usize) {
        self.bits[at >> 6] &= !(1 << (at & 63));
        self.add(at >> 6, u32::MAX);
    }

    /// Set times in 0..=at.
    fn prefix(&self, at: usize) -> u32 {
        let w = at >> 6;
        let mut sum = (self.bits[w] & (u64::MAX >> (63 - (at & 63)))).count_ones();
        let mut i = w;
        while i > 0 {
            sum += self.tree[i];
            i &= i - 1;
        }
        sum
    }

    /// Per word, the set times in the words before it.
    fn before_words(&self) -> Vec<u32> {
        let mut sum = 0;
        self.bits
            .iter()
            .map(|b| {
                let before = sum;
                sum += b.count_ones();
                before
            })
            .collect()
    }
}

pub struct Stack {
    max_keys: usize,
    /// times 0..size before the next compaction
    size: usize,
    /// the next access's time
    t: usize,
    keys: Keys,
    marks: Marks,
    /// keys dropped by the bound (stackdist.py's `forgotten`)
    forgotten: u64,
}

impl Stack {
    pub fn new(max_keys: usize) -> Self {
        Self {
            max_keys: max_keys.max(1),
            size: INITIAL_SIZE,
            t: 0,
            keys: Keys::default(),
            marks: Marks::with_prefix(INITIAL_SIZE, 0),
            forgotten: 0,
        }
    }

    /// A stack whose keys (distinct) were last accessed in this order, oldest first, compacting after
    /// `room` more accesses: the state a Python stack holds in `order()` and `room()`, all of it (a
    /// live stack may hold more than `max_keys` until it compacts). A stack rebuilt with
    /// `StackDistance.from_order` from n keys has room `max(16, 2n) - n`.
    pub fn install(max_keys: usize, order: &[u64], room: usize) -> Result<Self, String> {
        let n = order.len();
        let size = n
            .checked_add(room)
            .filter(|&s| s < u32::MAX as usize)
            .ok_or_else(|| {
                format!("a stack of {n} keys with room for {room} more accesses is too large")
            })?;
        let mut keys = Keys::with_capacity_and_hasher(n, RandomState::default());
        for (t, &k) in order.iter().enumerate() {
            let entry = Entry {
                t: t as u32,
                reason: NO_END,
                removed_ts: 0.0,
            };
            if keys.insert(k, entry).is_some() {
                return Err(format!(
                    "key {k} is twice in the stack's order (times {t} and earlier)"
                ));
            }
        }
        Ok(Self {
            max_keys: max_keys.max(1),
            size,
            t: n,
            keys,
            marks: Marks::with_prefix(size, n),
            forgotten: 0,
        })
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    pub fn entry_mut(&mut self, key: u64) -> Option<&mut Entry> {
        self.keys.get_mut(&key)
    }

    /// Whether the next access compacts first.
    pub fn full(&self) -> bool {
        self.t >= self.size
    }

    /// Accesses before the next compaction (stackdist.py's `room`).
    pub fn room(&self) -> usize {
        self.size - self.t
    }

    pub fn forgotten(&self) -> u64 {
        self.forgotten
    }

    /// The remembered keys, least recently accessed first.
    pub fn order(&self) -> Vec<u64> {
        let mut at: Vec<Option<u64>> = vec![None; self.t];
        for (&k, e) in &self.keys {
            at[e.t as usize] = Some(k);
        }
        at.into_iter().flatten().collect()
    }

    /// Times 0..n-1 for the live keys in time order, the least recent past `max_keys` forgotten (stackdist.py
    /// `_compact`). In place: a key's new time is its rank among the live times, read off the marks.
    pub fn compact(&mut self) {
        let n = self.keys.len();
        let drop = n.saturating_sub(self.max_keys);
        let before = self.marks.before_words();
        let bits = &self.marks.bits;
        self.keys.retain(|_, e| {
            let t = e.t as usize;
            let rank = before[t >> 6] as usize
                + (bits[t >> 6] & ((1u64 << (t & 63)) - 1)).count_ones() as usize;
            e.t = rank.wrapping_sub(drop) as u32;
            rank >= drop
        });
        let n = n - drop;
        if self.keys.capacity() > 4 * n + 1024 {
            self.keys.shrink_to(2 * n); // after a drop, not the most the slot ever held
        }
        self.forgotten += drop as u64;
        // room for as many new accesses as there are live keys (stackdist.py `_install`)
        let size = (2 * n).max(MIN_SIZE);
        assert!(
            size < u32::MAX as usize,
            "a slot of {n} keys: times past 32 bits"
        );
        self.size = size;
        self.t = n;
        self.marks.reset(size, n);
    }

    /// One access at the next time (the caller compacts first when `full()`): its stack distance, None
    /// on a first (remembered) access, and the end recorded for the key, taken.
    #[inline]
    pub fn access(&mut self, key: u64) -> (Option<u64>, Option<(f64, u32)>) {
        debug_assert!(self.t < self.size, "compact before accessing a full stack");
        let t = self.t;
        self.t += 1;
        let live = self.keys.len() as u32;
        match self.keys.entry(key) {
            MapEntry::Occupied(mut o) => {
                let e = o.get_mut();
                let p = e.t as usize;
                let distance = live - self.marks.prefix(p);
                self.marks.unset(p);
                self.marks.set(t);
                e.t = t as u32;
                (Some(distance as u64), e.take_end())
            }
            MapEntry::Vacant(v) => {
                v.insert(Entry {
                    t: t as u32,
                    reason: NO_END,
                    removed_ts: 0.0,
                });
                self.marks.set(t);
                (None, None)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::captrack::Rng;

    /// The definition, without the structure: a history of accesses, the remembered keys found by
    /// running Python's compaction schedule on a plain list, and each distance as the number of
    /// distinct keys accessed since the key's previous access.
    fn brute(accesses: &[u64], max_keys: usize, size: usize, t: usize) -> Vec<Option<u64>> {
        let (mut size, mut t) = (size, t);
        let mut live: Vec<(u64, usize)> = Vec::new(); // (key, its latest access in `history`)
        let mut history: Vec<u64> = Vec::new();
        let mut out = Vec::new();
        for &k in accesses {
            if t >= size {
                live.sort_by_key(|&(_, at)| at);
                let drop = live.len().saturating_sub(max_keys);
                live.drain(..drop);
                size = (2 * live.len()).max(MIN_SIZE);
                t = live.len();
            }
            let at = history.len();
            match live.iter().position(|&(key, _)| key == k) {
                Some(i) => {
                    let since: std::collections::HashSet<u64> =
                        history[live[i].1 + 1..].iter().copied().collect();
                    out.push(Some(since.len() as u64));
                    live[i].1 = at;
                }
                None => {
                    out.push(None);
                    live.push((k, at));
                }
            }
            history.push(k);
            t += 1;
        }
        out
    }

    fn stream(rng: &mut Rng, n: usize, pool: u64) -> Vec<u64> {
        (0..n).map(|_| rng.below(pool)).collect()
    }

    #[test]
    fn distances_equal_the_distinct_count_across_compactions_and_forgetting() {
        for seed in 0..40 {
            let mut rng = Rng(seed);
            let max_keys = [1, 3, 8, 16, 40, 1 << 20][seed as usize % 6];
            let pool = 1 + rng.below(90);
            let accesses = stream(&mut rng, 6000, pool);
            let mut stack = Stack::new(max_keys);
            let got: Vec<_> = accesses
                .iter()
                .map(|&k| {
                    if stack.full() {
                        stack.compact();
                    }
                    stack.access(k).0
                })
                .collect();
            assert_eq!(
                got,
                brute(&accesses, max_keys, INITIAL_SIZE, 0),
                "seed {seed}"
            );
            assert!(stack.len() <= (2 * max_keys).max(MIN_SIZE) + INITIAL_SIZE);
        }
    }

    #[test]
    fn a_forgotten_key_is_a_first_access_again() {
        let mut stack = Stack::install(10, &[], 0).unwrap(); // compacts at once: size 16
        for k in 0..40 {
            if stack.full() {
                stack.compact();
            }
            stack.access(k);
        }
        assert!(stack.forgotten() > 0 && stack.len() <= 20);
        if stack.full() {
            stack.compact();
        }
        assert_eq!(stack.access(0), (None, None));
    }

    #[test]
    fn an_installed_stack_goes_on_as_the_one_it_was_read_from() {
        for seed in 0..20 {
            let mut rng = Rng(100 + seed);
            let max_keys = 1 + rng.below(30) as usize;
            let history = stream(&mut rng, 700, 60);
            let more = stream(&mut rng, 700, 80);
            let mut original = Stack::install(max_keys, &[], rng.below(20) as usize).unwrap();
            let step = |s: &mut Stack, k: u64| {
                if s.full() {
                    s.compact();
                }
                s.access(k).0
            };
            for &k in &history {
                step(&mut original, k);
            }
            let mut copy = Stack::install(max_keys, &original.order(), original.room()).unwrap();
            let a: Vec<_> = more.iter().map(|&k| step(&mut original, k)).collect();
            let b: Vec<_> = more.iter().map(|&k| step(&mut copy, k)).collect();
            assert_eq!(a, b, "seed {seed}");
            assert_eq!(original.order(), copy.order());
        }
    }

    #[test]
    fn ends_stay_with_their_key_until_it_is_stored_again_or_forgotten() {
        let mut stack = Stack::install(2, &[1, 2, 3], 3).unwrap();
        stack.entry_mut(2).unwrap().reason = 7;
        stack.entry_mut(1).unwrap().reason = 5;
        assert_eq!(stack.access(4), (None, None));
        assert_eq!(stack.access(2).1, Some((0.0, 7)));
        assert_eq!(stack.access(2), (Some(0), None)); // taken by the store before
        stack.compact(); // keeps the 2 most recent: 4, 2; forgets 1 (and its end) and 3
        assert_eq!(stack.order(), vec![4, 2]);
        assert!(stack.entry_mut(1).is_none() && stack.forgotten() == 2);
    }

    #[test]
    fn install_refuses_a_key_twice() {
        assert!(Stack::install(8, &[1, 2, 1], 4)
            .err()
            .unwrap()
            .contains("twice"));
    }
}
