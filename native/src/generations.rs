//! Two generations of a map bounded by a size its entries declare: where the digest memo
//! (`hashmemo.rs`) and the id-text memo (`idtext.rs`) keep their segments.
//!
//! When an insert would take the newer generation past `half`, the older one is dropped whole and
//! the newer becomes the older: an approximate LRU that writes nothing on a hit (lookups share a
//! read lock). An entry read from the older generation is admitted again by its memo, into the newer.

use hashbrown::HashMap;

pub(crate) struct Generations<S> {
    newer: HashMap<u64, (S, usize)>,
    older: HashMap<u64, (S, usize)>,
    newer_size: usize,
    older_size: usize,
    half: usize,
}

impl<S> Generations<S> {
    /// At most `half` in each generation (entries larger than that are the caller's to cut).
    pub(crate) fn new(half: usize) -> Self {
        Generations {
            newer: HashMap::new(),
            older: HashMap::new(),
            newer_size: 0,
            older_size: 0,
            half,
        }
    }

    /// What `take` makes of the entry keyed `key`, the newer generation's first (the older's where
    /// the newer has none or `take` turns it down), and whether it came from the newer.
    pub(crate) fn find<'a, T>(
        &'a self,
        key: u64,
        take: impl Fn(&'a S) -> Option<T>,
    ) -> Option<(T, bool)> {
        let from = |m: &'a HashMap<u64, (S, usize)>| m.get(&key).and_then(|(s, _)| take(s));
        from(&self.newer)
            .map(|t| (t, true))
            .or_else(|| from(&self.older).map(|t| (t, false)))
    }

    /// `entry` (of `size`) under `key` in the newer generation, in place of any entry there.
    pub(crate) fn insert(&mut self, key: u64, entry: S, size: usize) {
        if self.newer_size + size > self.half {
            self.older = std::mem::take(&mut self.newer);
            self.older_size = std::mem::replace(&mut self.newer_size, 0);
        }
        if let Some((_, old)) = self.newer.insert(key, (entry, size)) {
            self.newer_size -= old;
        }
        self.newer_size += size;
    }

    /// The size held in both generations.
    pub(crate) fn held(&self) -> usize {
        self.newer_size + self.older_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newer_first_then_older_and_bounded() {
        let mut g: Generations<&str> = Generations::new(10);
        g.insert(1, "a", 6);
        g.insert(2, "b", 3);
        assert_eq!(g.find(1, |s| Some(*s)), Some(("a", true)));
        g.insert(3, "c", 4); // past 10: the newer (a, b) becomes the older
        assert_eq!(g.find(1, |s| Some(*s)), Some(("a", false)));
        assert_eq!(g.find(3, |s| Some(*s)), Some(("c", true)));
        assert_eq!(g.held(), 13);
        g.insert(1, "a2", 2); // the newer's own key 1, over the older's
        assert_eq!(g.find(1, |s| Some(*s)), Some(("a2", true)));
        assert_eq!(
            g.find(1, |s| (*s != "a2").then_some(*s)),
            Some(("a", false))
        );
        g.insert(3, "c2", 1); // replaces: the newer holds 2 + 1
        assert_eq!(g.held(), 3 + 9);
        g.insert(4, "d", 8); // past 10 again: a, b dropped
        assert_eq!(g.find(2, |s| Some(*s)), None);
        assert_eq!(g.held(), 3 + 8);
    }
}
