//! Replayable seeds for randomised tests.

use std::time::{SystemTime, UNIX_EPOCH};

/// A seed for the randomised test `case`: the integer in the environment
/// variable `env_var` if it is set and parses, else the clock's
/// nanoseconds. It is always printed to stderr together with `env_var`, so
/// a failing run can be replayed with `env_var=<seed>`.
pub fn replayable(env_var: &str, case: &str) -> u64 {
    let seed = std::env::var(env_var)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("{case}: seed {seed} (replay with {env_var}={seed})");
    seed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_wins_over_the_clock() {
        std::env::set_var("ONECOPY_SEED_UNIT_TEST", "12345");
        assert_eq!(replayable("ONECOPY_SEED_UNIT_TEST", "unit"), 12345);
        std::env::remove_var("ONECOPY_SEED_UNIT_TEST");
    }
}
