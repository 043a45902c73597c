//! The locality cache: whole segment pages (groups of entries in the order
//! they were inserted), evicted by CLOCK (second chance) at a bound on
//! entries held.

use std::collections::{HashMap, VecDeque};

use crate::KeyMap;

struct Group {
    id: u64,
    keys: Vec<u128>,
    referenced: bool,
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
    /// Device reads that loaded groups ([`Cache::note_read`]), and the
    /// lookups the cache answered since, over a decaying window: whether
    /// loading neighbours pays off for the workload at hand.
    reads: u64,
    served: u64,
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
        }
        self.served += 1;
        if self.served >= 1 << 40 {
            self.decay();
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
        });
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

    /// One device read loaded groups (however many: a slow device reads
    /// a window of several pages at once).
    pub fn note_read(&mut self) {
        self.reads += 1;
        if self.reads >= 1024 {
            self.decay();
        }
    }

    fn decay(&mut self) {
        self.reads /= 2;
        self.served /= 2;
    }

    /// True when the reads that loaded groups lately (at least 64) saved
    /// fewer lookups than they cost: fewer cache answers than reads. Then
    /// the lookups have no locality to exploit: random lookups find a
    /// loaded entry about as often as the cache covers the index (5% for
    /// the default 1 M entries at 20 M), a read per lookup and 0.05
    /// answers per read. Counted per read, not per group loaded: a slow
    /// device's read loads a window of 16 pages of which a stream uses a
    /// few, many times over (counted per group, a 25% bar judged such a
    /// stream poor and skipped 31 loads in 32: 955 k disk lookups instead
    /// of 152 k on the seed's trace with 10 ms reads).
    pub fn locality_poor(&self) -> bool {
        self.reads >= 64 && self.served < self.reads
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
            c.note_read();
        }
        assert!(c.locality_poor());
        for g in 0..300u64 {
            c.get(g as u128 * 1000);
        }
        assert!(!c.locality_poor());
    }

    /// Reads of 16-page windows of which a stream uses one page, many
    /// times over, pay for themselves; the same reads answering a lookup
    /// in twenty do not.
    #[test]
    fn a_window_read_pays_by_the_lookups_it_saves() {
        let mut c = Cache::new(1 << 20);
        for w in 0..100u64 {
            for g in w * 16..w * 16 + 16 {
                c.insert_group(g, (0..8u128).map(|k| (g as u128 * 100 + k, g)));
            }
            c.note_read();
            // The stream walks one page of the window, all 8 entries.
            for k in 0..8u128 {
                assert!(c.get(w as u128 * 1600 + k).is_some());
            }
        }
        assert!(
            !c.locality_poor(),
            "one page in 16 used, 8 lookups saved per read"
        );
        for w in 100..2000u64 {
            c.insert_group(w * 16, [(w as u128 * 1600, 1)]);
            c.note_read();
            if w % 20 == 0 {
                c.get(w as u128 * 1600);
            }
        }
        assert!(c.locality_poor(), "one lookup saved in 20 reads");
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
