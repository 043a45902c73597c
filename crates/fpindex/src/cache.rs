//! The locality cache: whole segment pages (groups of entries in the order
//! they were inserted), evicted by CLOCK (second chance) at a bound on
//! entries held.

use std::collections::{HashMap, VecDeque};

use crate::KeyMap;

struct Group {
    keys: Vec<u128>,
    referenced: bool,
}

#[derive(Default)]
pub struct Cache {
    map: KeyMap<(u64, u64)>,
    groups: HashMap<u64, Group>,
    clock: VecDeque<u64>,
    capacity: usize,
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
        let &(loc, group) = self.map.get(&key)?;
        if let Some(g) = self.groups.get_mut(&group) {
            g.referenced = true;
        }
        Some(loc)
    }

    pub fn has_group(&self, group: u64) -> bool {
        self.groups.contains_key(&group)
    }

    /// Caches a group of live `(key, location)` pairs.
    pub fn insert_group(&mut self, group: u64, entries: impl IntoIterator<Item = (u128, u64)>) {
        if self.capacity == 0 || self.groups.contains_key(&group) {
            return;
        }
        let mut keys = Vec::new();
        for (k, l) in entries {
            self.map.insert(k, (l, group));
            keys.push(k);
        }
        self.groups.insert(
            group,
            Group {
                keys,
                referenced: false,
            },
        );
        self.clock.push_back(group);
        while self.map.len() > self.capacity && self.evict_one() {}
    }

    fn evict_one(&mut self) -> bool {
        while let Some(g) = self.clock.pop_front() {
            let Some(group) = self.groups.get_mut(&g) else {
                continue;
            };
            if group.referenced {
                group.referenced = false;
                self.clock.push_back(g);
                continue;
            }
            let group = self.groups.remove(&g).unwrap_or(Group {
                keys: Vec::new(),
                referenced: false,
            });
            for k in group.keys {
                if self.map.get(&k).is_some_and(|&(_, owner)| owner == g) {
                    self.map.remove(&k);
                }
            }
            return true;
        }
        false
    }

    /// Forgets `key` (it was deleted).
    pub fn remove(&mut self, key: u128) {
        self.map.remove(&key);
    }

    pub fn clear(&mut self) {
        self.map.clear();
        self.groups.clear();
        self.clock.clear();
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
        c.remove(5);
        assert_eq!(c.get(5), None);
    }
}
