//! Writing float32 `.npy` files (NumPy format 1.0), atomically.

use std::io::Write;
use std::path::Path;

/// Writes `data` as a little-endian float32 array of `shape`.
pub fn write_f32(path: &Path, shape: &[usize], data: &[f32]) -> anyhow::Result<()> {
    anyhow::ensure!(
        shape.iter().product::<usize>() == data.len(),
        "npy shape {shape:?} does not match {} values",
        data.len()
    );
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_txt = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_txt}, }}");
    // Magic (6) + version (2) + length (2) + header + '\n' is a multiple of 64.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.div_ceil(64) * 64 - unpadded));
    header.push('\n');

    let dir = path.parent().filter(|p| !p.as_os_str().is_empty());
    let tmp = path.with_extension(format!("npy.tmp-{}", std::process::id()));
    let result = (|| -> std::io::Result<()> {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
        f.write_all(b"\x93NUMPY\x01\x00")?;
        f.write_all(&(header.len() as u16).to_le_bytes())?;
        f.write_all(header.as_bytes())?;
        for v in data {
            f.write_all(&v.to_le_bytes())?;
        }
        f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&tmp, path)?;
        if let Some(d) = dir {
            std::fs::File::open(d)?.sync_all()?;
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))
}

/// Reads a float32 `.npy` written by NumPy or [`write_f32`]: (shape, data).
pub fn read_f32(path: &Path) -> anyhow::Result<(Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path)?;
    anyhow::ensure!(
        bytes.len() > 10 && &bytes[..6] == b"\x93NUMPY",
        "not an npy file"
    );
    let (hlen, start) = if bytes[6] == 1 {
        (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10)
    } else {
        (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        )
    };
    let header = std::str::from_utf8(&bytes[start..start + hlen])?;
    anyhow::ensure!(header.contains("'<f4'"), "npy dtype is not float32");
    anyhow::ensure!(header.contains("'fortran_order': False"), "fortran order");
    let shape_txt = header
        .split("'shape':")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .ok_or_else(|| anyhow::anyhow!("npy header has no shape"))?;
    let shape: Vec<usize> = shape_txt
        .trim_start_matches([' ', '('])
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<usize>())
        .collect::<Result<_, _>>()?;
    let body = &bytes[start + hlen..];
    let n: usize = shape.iter().product();
    anyhow::ensure!(body.len() == n * 4, "npy body has the wrong length");
    let data = body
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok((shape, data))
}
