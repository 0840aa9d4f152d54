//! A bounded slab of in-flight operations. The key of an entry is the `user_data` of its SQE,
//! and the entry owns every buffer the kernel may touch until the completion is reaped.

/// In-flight operations of one ring, at most `capacity_max` at once.
#[derive(Debug)]
pub struct InFlight<T> {
    slab: slab::Slab<T>,
    capacity_max: usize,
}

impl<T> InFlight<T> {
    /// An empty table that refuses entries beyond `capacity_max`.
    pub fn new(capacity_max: usize) -> Self {
        InFlight {
            slab: slab::Slab::with_capacity(capacity_max),
            capacity_max,
        }
    }

    /// Stores `op` and returns its key, or gives `op` back when the table is full: the caller
    /// must reap completions before issuing more (back-pressure, never growth).
    pub fn insert(&mut self, op: T) -> Result<u64, T> {
        if self.slab.len() >= self.capacity_max {
            return Err(op);
        }
        Ok(self.slab.insert(op) as u64)
    }

    /// The operation with this key, if it is still in flight.
    pub fn get_mut(&mut self, key: u64) -> Option<&mut T> {
        self.slab.get_mut(usize::try_from(key).ok()?)
    }

    /// The operation with this key, if it is still in flight.
    pub fn get(&self, key: u64) -> Option<&T> {
        self.slab.get(usize::try_from(key).ok()?)
    }

    /// Removes the operation whose completion was reaped.
    pub fn remove(&mut self, key: u64) -> Option<T> {
        self.slab.try_remove(usize::try_from(key).ok()?)
    }

    /// Operations in flight.
    pub fn len(&self) -> usize {
        self.slab.len()
    }

    /// True when nothing is in flight.
    pub fn is_empty(&self) -> bool {
        self.slab.is_empty()
    }

    /// Iterates over `(key, op)`.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &T)> {
        self.slab.iter().map(|(k, v)| (k as u64, v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_and_keys_reused() {
        let mut t = InFlight::new(2);
        let a = t.insert("a").unwrap();
        let b = t.insert("b").unwrap();
        assert_eq!(t.insert("c"), Err("c"));
        assert_eq!(t.remove(a), Some("a"));
        assert_eq!(t.remove(a), None);
        let c = t.insert("c").unwrap();
        assert_eq!(t.get(c), Some(&"c"));
        assert_eq!(t.get(b), Some(&"b"));
        assert_eq!(t.len(), 2);
    }
}
