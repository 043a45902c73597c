//! Which snapshots a retention policy keeps, in the style of `restic
//! forget`: the N most recent, and the most recent of each of the last N
//! days, ISO weeks, months and years that have snapshots (days, weeks,
//! months and years in UTC). A snapshot any rule keeps is kept.

use serde::{Deserialize, Serialize};

use crate::error::{Result, StoreError};
use crate::snap::Snapshot;
use crate::store::Store;

/// A retention policy (0: the rule keeps nothing).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Keep {
    pub last: u32,
    pub daily: u32,
    pub weekly: u32,
    pub monthly: u32,
    pub yearly: u32,
}

/// What a policy keeps and removes, each oldest first.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ForgetReport {
    pub keep: Vec<Snapshot>,
    pub remove: Vec<Snapshot>,
    /// Stored bytes `gc` frees once they are gone (the chunks only the
    /// removed snapshots, and no kept one, hold).
    pub frees_bytes: u64,
}

/// The calendar buckets of a time: day, ISO week (Monday first), month,
/// year, as keys that sort like time.
fn buckets(time_ns: i64) -> [String; 4] {
    let secs = time_ns.max(0) as u64 / 1_000_000_000;
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs);
    let date = humantime::format_rfc3339_seconds(t).to_string();
    // 1970-01-01 was a Thursday: day + 3 counts from a Monday.
    let week = (secs / 86_400 + 3) / 7;
    [
        date[..10].to_string(),
        format!("w{week:08}"),
        date[..7].to_string(),
        date[..4].to_string(),
    ]
}

/// Splits `snaps` (any order) into kept and removed by `keep`. A policy
/// that keeps nothing is refused: it would remove every snapshot.
pub fn plan(snaps: &[Snapshot], keep: Keep) -> Result<ForgetReport> {
    if keep == Keep::default() {
        return Err(StoreError::BadOption(
            "no policy given (--keep-last, --keep-daily, --keep-weekly, --keep-monthly, \
             --keep-yearly): it would remove every snapshot"
                .into(),
        ));
    }
    let mut newest_first: Vec<&Snapshot> = snaps.iter().collect();
    newest_first.sort_by_key(|s| std::cmp::Reverse((s.time_ns, s.id)));
    let mut kept = vec![false; newest_first.len()];
    for k in kept.iter_mut().take(keep.last as usize) {
        *k = true;
    }
    let limits = [keep.daily, keep.weekly, keep.monthly, keep.yearly];
    let keys: Vec<[String; 4]> = newest_first.iter().map(|s| buckets(s.time_ns)).collect();
    for (rule, &limit) in limits.iter().enumerate() {
        let mut seen: Vec<&str> = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            let b = k[rule].as_str();
            if seen.len() < limit as usize && !seen.contains(&b) {
                seen.push(b);
                kept[i] = true;
            }
        }
    }
    let mut rep = ForgetReport::default();
    for (s, k) in newest_first.into_iter().zip(kept).rev() {
        match k {
            true => rep.keep.push(s.clone()),
            false => rep.remove.push(s.clone()),
        }
    }
    Ok(rep)
}

impl Store {
    /// Deletes the snapshots `keep` does not keep (unless `dry_run`), in
    /// one durable commit; `gc` then frees what only they held.
    pub fn snapshot_forget(&self, keep: Keep, dry_run: bool) -> Result<ForgetReport> {
        let mut g = self.lock();
        let mut rep = plan(&crate::snap::list(&g.db)?, keep)?;
        // Removed inside a savepoint: a dry run rolls it back after
        // counting what gc would free.
        g.db.execute_batch("SAVEPOINT forget")?;
        let counted = (|| {
            for s in &rep.remove {
                crate::snap::remove(&g.db, s.id)?;
            }
            crate::snap::reclaimable_bytes(&g.db)
        })();
        let end = match (&counted, dry_run) {
            (Ok(_), false) => "RELEASE forget",
            _ => "ROLLBACK TO forget; RELEASE forget",
        };
        g.db.execute_batch(end)?;
        // ROLLBACK TO calls no rollback hook.
        g.attrs.clear();
        rep.frees_bytes = counted?;
        if !dry_run && !rep.remove.is_empty() {
            self.commit_locked(&mut g, true)?;
        }
        Ok(rep)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: i64 = 86_400_000_000_000;

    /// Snapshots at these times (days from 2026-11-02, a Monday, plus an
    /// hour offset in ns), ids in order.
    fn at(days: &[(i64, i64)]) -> Vec<Snapshot> {
        let monday = 1_793_577_600 * 1_000_000_000i64;
        days.iter()
            .enumerate()
            .map(|(i, &(d, h))| Snapshot {
                id: i as u64 + 1,
                name: format!("s{}", i + 1),
                epoch: i as u64,
                time_ns: monday + d * DAY + h * 3_600_000_000_000,
            })
            .collect()
    }

    fn names(v: &[Snapshot]) -> Vec<&str> {
        v.iter().map(|s| s.name.as_str()).collect()
    }

    #[test]
    fn rules_keep_the_newest_of_each_bucket() {
        assert_eq!(buckets(1_793_577_600 * 1_000_000_000)[0], "2026-11-02");
        // Two a day for 10 days (Mon 2 Nov .. Wed 11 Nov).
        let snaps = at(&(0..20)
            .map(|i| (i / 2, 6 + 12 * (i % 2)))
            .collect::<Vec<_>>());
        let keep = |k: Keep| plan(&snaps, k).unwrap();
        let r = keep(Keep {
            last: 3,
            ..Keep::default()
        });
        assert_eq!(names(&r.keep), ["s18", "s19", "s20"]);
        assert_eq!(r.remove.len(), 17);
        let r = keep(Keep {
            daily: 3,
            ..Keep::default()
        });
        assert_eq!(
            names(&r.keep),
            ["s16", "s18", "s20"],
            "the last of each day"
        );
        let r = keep(Keep {
            weekly: 2,
            ..Keep::default()
        });
        assert_eq!(
            names(&r.keep),
            ["s14", "s20"],
            "Sunday 8 Nov's last, and today's"
        );
        let r = keep(Keep {
            monthly: 5,
            ..Keep::default()
        });
        assert_eq!(names(&r.keep), ["s20"]);
        let r = keep(Keep {
            last: 1,
            daily: 2,
            weekly: 2,
            ..Keep::default()
        });
        assert_eq!(names(&r.keep), ["s14", "s18", "s20"], "rules add up");
        assert!(
            plan(&snaps, Keep::default()).is_err(),
            "no policy, no forget"
        );
    }
}
