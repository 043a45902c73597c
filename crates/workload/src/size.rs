//! Human-readable sizes: `4096`, `64k`, `512M`, `2G`, `1.5GiB`, `1T`.
//! Units are binary (k = 1024).

pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim().to_ascii_lowercase();
    let mult: u64 = match unit.trim_end_matches("ib").trim_end_matches('b') {
        "" => 1,
        "k" => 1 << 10,
        "m" => 1 << 20,
        "g" => 1 << 30,
        "t" => 1 << 40,
        _ => return Err(format!("unknown size unit in {s:?} (use k, M, G, T)")),
    };
    if num.is_empty() {
        return Err(format!("no number in size {s:?}"));
    }
    if let Ok(n) = num.parse::<u64>() {
        return n
            .checked_mul(mult)
            .ok_or_else(|| format!("size {s:?} overflows"));
    }
    let f: f64 = num.parse().map_err(|_| format!("bad number in {s:?}"))?;
    let v = f * mult as f64;
    if !(0.0..1.8e19).contains(&v) {
        return Err(format!("size {s:?} out of range"));
    }
    Ok(v as u64)
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64k"), Ok(65536));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert_eq!(parse_size("1 TB"), Ok(1 << 40));
        assert!(parse_size("12X").is_err());
        assert!(parse_size("G").is_err());
    }
}
