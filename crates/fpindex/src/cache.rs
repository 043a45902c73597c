//! The locality cache: whole segment pages (groups of entries in the order
//! they were inserted), evicted by CLOCK (second chance) at a bound on
//! entries held.

use std::collections::{HashMap, VecDeque};

use crate::KeyMap;

struct Group {
    id: u64,
    keys: Vec<u128>,
    referenced: bool,
    used: bool,
}

#[derive(Default)]
pub struct Cache {
    /// Key to (location, slot in `slab`).
    map: KeyMap<(u64, u32)>,
    slab: Vec<Option<Group>>,
    free: Vec<u32>,
    by_id: HashMap<u64, u32>,
    clock: VecDeque<u32>,
    /// Keys held by the groups in `slab` (a key loaded by two overlapping
    /// groups counts twice; one removed stays counted until its group
    /// goes): what `capacity` bounds, so that memory is bounded even when
    /// `map` is not growing.
    held: usize,
    capacity: usize,
    /// Groups loaded, and those of them hit since, over a decaying window:
    /// whether loading neighbours pays off for the workload at hand.
    loaded: u32,
    loaded_used: u32,
}

impl Cache {
    pub fn new(capacity: usize) -> Self {
        Cache {
            capacity,
            ..Default::default()
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// The location of `key` if cached; marks its group recently used.
    pub fn get(&mut self, key: u128) -> Option<u64> {
        let &(loc, slot) = self.map.get(&key)?;
        if let Some(Some(g)) = self.slab.get_mut(slot as usize) {
            g.referenced = true;
            if !g.used {
                g.used = true;
                self.loaded_used += 1;
            }
        }
        Some(loc)
    }

    pub fn has_group(&self, group: u64) -> bool {
        self.by_id.contains_key(&group)
    }

    /// Caches a group of live `(key, location)` pairs.
    pub fn insert_group(&mut self, group: u64, entries: impl IntoIterator<Item = (u128, u64)>) {
        if self.capacity == 0 || self.by_id.contains_key(&group) {
            return;
        }
        let slot = self.free.pop().unwrap_or_else(|| {
            self.slab.push(None);
            (self.slab.len() - 1) as u32
        });
        let mut keys = Vec::new();
        for (k, l) in entries {
            self.map.insert(k, (l, slot));
            keys.push(k);
        }
        self.held += keys.len();
        self.slab[slot as usize] = Some(Group {
            id: group,
            keys,
            referenced: false,
            used: false,
        });
        self.loaded += 1;
        if self.loaded >= 1024 {
            self.loaded /= 2;
            self.loaded_used /= 2;
        }
        self.by_id.insert(group, slot);
        self.clock.push_back(slot);
        while self.held > self.capacity && self.evict_one() {}
    }

    fn evict_one(&mut self) -> bool {
        while let Some(slot) = self.clock.pop_front() {
            let Some(Some(group)) = self.slab.get_mut(slot as usize) else {
                continue;
            };
            if group.referenced {
                group.referenced = false;
                self.clock.push_back(slot);
                continue;
            }
            let Some(group) = self.slab[slot as usize].take() else {
                continue;
            };
            self.by_id.remove(&group.id);
            self.held -= group.keys.len();
            for k in group.keys {
                if self.map.get(&k).is_some_and(|&(_, owner)| owner == slot) {
                    self.map.remove(&k);
                }
            }
            self.free.push(slot);
            return true;
        }
        false
    }

    /// True when neighbours loaded lately were seldom used (under a
    /// quarter of at least 256 groups): the lookups have no locality to
    /// exploit. The bar is well above chance: random lookups use a loaded
    /// group about as often as the cache covers the index (5% for the
    /// default 1 M entries at 20 M), which under a 5% bar kept random
    /// workloads prefetching (1.15 device reads per lookup at 20 M).
    pub fn locality_poor(&self) -> bool {
        self.loaded >= 256 && self.loaded_used * 4 < self.loaded
    }

    /// Forgets `key` (it was deleted).
    pub fn remove(&mut self, key: u128) {
        self.map.remove(&key);
    }

    pub fn clear(&mut self) {
        *self = Cache::new(self.capacity);
    }
}

#[cfg(test)]
mod locality_tests {
    use super::*;

    #[test]
    fn notices_useless_prefetch() {
        let mut c = Cache::new(1 << 20);
        for g in 0..300u64 {
            c.insert_group(g, [(g as u128 * 1000, 1), (g as u128 * 1000 + 1, 2)]);
        }
        assert!(c.locality_poor());
        for g in 0..300u64 {
            c.get(g as u128 * 1000);
        }
        assert!(!c.locality_poor());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_and_second_chance() {
        let mut c = Cache::new(4);
        c.insert_group(1, [(1, 10), (2, 20)]);
        c.insert_group(2, [(3, 30), (4, 40)]);
        assert_eq!(c.get(1), Some(10));
        c.insert_group(3, [(5, 50)]);
        // Group 1 was referenced, group 2 goes.
        assert_eq!(c.get(3), None);
        assert_eq!(c.get(2), Some(20));
        assert_eq!(c.get(5), Some(50));
        assert!(c.len() <= 4);
        assert!(c.has_group(1) && !c.has_group(2));
        c.remove(5);
        assert_eq!(c.get(5), None);
        c.insert_group(4, [(6, 60)]);
        assert_eq!(c.get(6), Some(60));
    }

    /// Groups that load keys already cached (overlapping prefetch
    /// windows) or whose keys were removed do not pile up: the keys the
    /// groups hold are bounded, not only the map (before, a map kept
    /// under its capacity let groups accumulate without bound).
    #[test]
    fn overlapping_and_emptied_groups_stay_bounded() {
        let mut c = Cache::new(100);
        for g in 0..10_000u64 {
            // Every group reloads the same 50 keys, then one is removed.
            c.insert_group(g, (0..50u128).map(|k| (k, g)));
            c.remove(g as u128 % 50);
        }
        let groups = c.slab.iter().filter(|g| g.is_some()).count();
        assert!(groups <= 3, "{groups} groups held");
        assert!(c.held <= 100 + 50, "{}", c.held);
        assert!(c.len() <= 50);
    }
}
