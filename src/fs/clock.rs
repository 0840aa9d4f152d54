//! A bounded map with CLOCK eviction: a pure data structure (no locks, no I/O).
//!
//! Every entry has a weight (1 for a plain entry; a directory's name set weighs its number
//! of names) and the sum of the weights never exceeds `weight_max`. A lookup sets the
//! entry's reference bit; to make room, the hand sweeps the slots, clearing set bits and
//! evicting the first entry whose bit is clear (second-chance LRU approximation: O(1)
//! amortised, and a hit only flips a bit).

use std::{borrow::Borrow, collections::HashMap, hash::Hash};

struct Slot<K, V> {
    key: K,
    val: V,
    weight: usize,
    referenced: bool,
}

/// A map of at most `weight_max` total weight.
pub(crate) struct ClockCache<K, V> {
    index: HashMap<K, usize>,
    slots: Vec<Slot<K, V>>,
    hand: usize,
    weight: usize,
    weight_max: usize,
    evictions: u64,
}

impl<K: Hash + Eq + Clone, V> ClockCache<K, V> {
    /// An empty cache holding at most `weight_max` (at least 1) total weight.
    pub(crate) fn new(weight_max: usize) -> Self {
        ClockCache {
            index: HashMap::new(),
            slots: Vec::new(),
            hand: 0,
            weight: 0,
            weight_max: weight_max.max(1),
            evictions: 0,
        }
    }

    /// The entry, marked recently used.
    pub(crate) fn get<Q>(&mut self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let i = *self.index.get(key)?;
        let s = self.slots.get_mut(i)?;
        s.referenced = true;
        Some(&s.val)
    }

    /// The entry for changing in place (not marked used: the watch edits entries too).
    pub(crate) fn get_mut<Q>(&mut self, key: &Q) -> Option<&mut V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let i = *self.index.get(key)?;
        self.slots.get_mut(i).map(|s| &mut s.val)
    }

    /// Inserts or replaces `key`, evicting until it fits. False (and nothing stored) when
    /// `weight` alone exceeds the limit.
    pub(crate) fn insert(&mut self, key: K, val: V, weight: usize) -> bool {
        let weight = weight.max(1);
        self.remove(&key);
        if weight > self.weight_max {
            return false;
        }
        while self.weight + weight > self.weight_max {
            self.evict_one();
        }
        self.index.insert(key.clone(), self.slots.len());
        self.slots.push(Slot {
            key,
            val,
            weight,
            referenced: false,
        });
        self.weight += weight;
        true
    }

    /// Changes an entry's weight (a name set grew or shrank), evicting others to make room;
    /// an entry too heavy for the whole cache is dropped.
    pub(crate) fn set_weight<Q>(&mut self, key: &Q, weight: usize)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let Some(&i) = self.index.get(key) else {
            return;
        };
        let Some(s) = self.slots.get(i) else { return };
        let k = s.key.clone();
        if let Some(v) = self.remove(key) {
            self.insert(k, v, weight);
        }
    }

    /// Removes `key`.
    pub(crate) fn remove<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let i = self.index.remove(key)?;
        Some(self.take_slot(i))
    }

    /// Drops every entry.
    pub(crate) fn clear(&mut self) {
        self.index.clear();
        self.slots.clear();
        self.hand = 0;
        self.weight = 0;
    }

    /// Every entry, in no particular order (not marked used).
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.slots.iter().map(|s| (&s.key, &s.val))
    }

    /// Entries held.
    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    /// Total weight held (never above the limit).
    pub(crate) fn weight(&self) -> usize {
        self.weight
    }

    /// Entries evicted to make room so far.
    pub(crate) fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Removes the slot at `i` (its index entry must be gone already).
    fn take_slot(&mut self, i: usize) -> V {
        let s = self.slots.swap_remove(i);
        self.weight -= s.weight;
        if let Some(moved) = self.slots.get(i) {
            self.index.insert(moved.key.clone(), i);
        }
        if self.hand >= self.slots.len() {
            self.hand = 0;
        }
        s.val
    }

    /// Evicts one entry: the first at or after the hand whose reference bit is clear,
    /// clearing the bits it passes. Ends within two sweeps.
    fn evict_one(&mut self) {
        loop {
            let Some(s) = self.slots.get_mut(self.hand) else {
                self.hand = 0;
                if self.slots.is_empty() {
                    return;
                }
                continue;
            };
            if s.referenced {
                s.referenced = false;
                self.hand += 1;
                continue;
            }
            let key = s.key.clone();
            self.index.remove(&key);
            let at = self.hand;
            self.take_slot(at);
            self.evictions += 1;
            return;
        }
    }

    #[cfg(test)]
    fn check(&self) {
        assert!(self.weight <= self.weight_max);
        assert_eq!(self.index.len(), self.slots.len());
        assert_eq!(
            self.weight,
            self.slots.iter().map(|s| s.weight).sum::<usize>()
        );
        for (i, s) in self.slots.iter().enumerate() {
            assert_eq!(self.index.get(&s.key), Some(&i));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_and_never_grows_past_its_limit() {
        let mut c = ClockCache::new(8);
        for k in 0..100u32 {
            assert!(c.insert(k, k * 10, 1));
            c.check();
            assert!(c.len() <= 8);
        }
        assert_eq!(c.len(), 8);
        assert_eq!(c.evictions(), 92);
        // The newest entries survive a sequential fill.
        assert_eq!(c.get(&99), Some(&990));
        assert_eq!(c.get(&0), None);
    }

    #[test]
    fn referenced_entries_get_a_second_chance() {
        let mut c = ClockCache::new(4);
        for k in 0..4u32 {
            c.insert(k, (), 1);
        }
        // 0 and 2 are used; the next two inserts evict the unused 1 and 3.
        assert!(c.get(&0).is_some());
        assert!(c.get(&2).is_some());
        c.insert(10, (), 1);
        c.insert(11, (), 1);
        c.check();
        assert!(c.get(&0).is_some() && c.get(&2).is_some());
        assert!(c.get(&1).is_none() && c.get(&3).is_none());
    }

    #[test]
    fn weights_bound_the_total() {
        let mut c: ClockCache<u32, Vec<u8>> = ClockCache::new(100);
        assert!(!c.insert(1, vec![], 101), "heavier than the cache");
        assert_eq!(c.len(), 0);
        for k in 0..50u32 {
            assert!(c.insert(k, vec![0; k as usize], (k as usize % 30) + 1));
            c.check();
        }
        c.insert(7, vec![], 60);
        c.check();
        assert!(c.weight() <= 100);
        // Growing an entry evicts others; growing it past the limit drops it.
        c.set_weight(&7, 90);
        c.check();
        assert!(c.get_mut(&7).is_some());
        c.set_weight(&7, 101);
        c.check();
        assert!(c.get(&7).is_none());
    }

    #[test]
    fn replace_remove_and_clear_keep_the_index_right() {
        let mut c = ClockCache::new(16);
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..5000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let k = (x % 40) as u32;
            match x % 5 {
                0 => {
                    c.remove(&k);
                }
                1 => {
                    c.get(&k);
                }
                2 => c.set_weight(&k, (x % 4) as usize + 1),
                _ => {
                    c.insert(k, x, (x % 3) as usize + 1);
                }
            }
            c.check();
        }
        c.clear();
        c.check();
        assert_eq!((c.len(), c.weight()), (0, 0));
    }
}
