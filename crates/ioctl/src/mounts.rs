//! The mount table, from `/proc/self/mountinfo`, with names unescaped:
//! one parser for every crate that asks what is mounted where.

use std::path::PathBuf;

/// One line of mountinfo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// `major:minor` of the mounted filesystem.
    pub dev: String,
    /// Where it is mounted.
    pub mount_point: PathBuf,
    /// Its type (`ext4`, `fuse.onecopy`, ...).
    pub fstype: String,
    /// What was mounted (a device, or a FUSE filesystem's name).
    pub source: String,
}

/// This process's mounts, in mount order (later ones on top).
pub fn read() -> std::io::Result<Vec<Mount>> {
    Ok(parse(&std::fs::read_to_string("/proc/self/mountinfo")?))
}

/// Parses mountinfo text; lines that do not parse are skipped.
/// Fields: id, parent, major:minor, root, mount point, options, optional
/// fields up to `-`, then type, source, super options.
pub fn parse(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let sep = f.iter().position(|&x| x == "-")?;
            Some(Mount {
                dev: f.get(2)?.to_string(),
                mount_point: PathBuf::from(unescape(f.get(4)?)),
                fstype: unescape(f.get(sep + 1)?),
                source: unescape(f.get(sep + 2)?),
            })
        })
        .collect()
}

/// Decodes mountinfo's octal escapes (`\040` for a space, `\011` tab,
/// `\012` newline, `\134` backslash).
pub fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let oct = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match oct {
            Some(d) if b[i] == b'\\' => {
                out.push(d.iter().fold(0u8, |v, c| v.wrapping_mul(8) + (c - b'0')));
                i += 4;
            }
            _ => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lines_with_optional_fields_and_escapes() {
        let text =
            "36 35 98:0 / /mnt/my\\040disk rw,noatime master:1 shared:2 - ext4 /dev/sd\\134a rw\n\
                    40 36 0:53 / /var/tmp/m rw,nosuid,nodev - fuse.onecopy onecopy:/srv/s rw\n\
                    garbage\n";
        let m = parse(text);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].mount_point, PathBuf::from("/mnt/my disk"));
        assert_eq!(m[0].source, "/dev/sd\\a");
        assert_eq!(m[0].dev, "98:0");
        assert_eq!(m[1].fstype, "fuse.onecopy");
        assert_eq!(m[1].source, "onecopy:/srv/s");
        assert_eq!(unescape("a\\011b\\012c\\9"), "a\tb\nc\\9");
        assert_eq!(unescape("/plain"), "/plain");
        assert_eq!(unescape("/end\\"), "/end\\");
    }
}
