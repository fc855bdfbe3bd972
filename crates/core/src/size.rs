//! Byte sizes as people write them on command lines.

/// Parses sizes like `8G`, `512M`, `1.5GiB`, `4096` into bytes; units are
/// binary (K = 1024) whatever their spelling (`G`, `GB`, `GiB`).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("bad size {s:?}: expected e.g. 8G or 512M"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" | "kib" => 1024.0,
        "m" | "mb" | "mib" => 1024.0 * 1024.0,
        "g" | "gb" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tb" | "tib" => 1024.0_f64.powi(4),
        _ => return Err(format!("bad size unit in {s:?}: use K, M, G or T")),
    };
    Ok((value * mult) as u64)
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn units_are_binary_and_spellings_agree() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("8G").unwrap(), 8 << 30);
        assert_eq!(parse_size("512m").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size(" 2 kb ").unwrap(), 2048);
        assert_eq!(parse_size("1T").unwrap(), 1 << 40);
    }

    #[test]
    fn bad_sizes_say_why() {
        assert!(parse_size("8X").unwrap_err().contains("unit"));
        assert!(parse_size("G").unwrap_err().contains("expected"));
        assert!(parse_size("").is_err());
    }
}
