//! `metrics`: the plugin's metrics endpoint (`GPUDIRECT_METRICS`) while a
//! send and a receive comm in this process move host memory, for
//! `testbed/prometheus_check.py --plugin`: it waits for the file named by
//! `GPUDIRECT_METRICS_GO` (Prometheus has scraped the idle plugin), moves
//! `iters` messages of `size` bytes, checking every byte, prints the bytes
//! it moved as `MOVED {json}`, and keeps the endpoint up until the file
//! named by `GPUDIRECT_METRICS_STOP` appears.

use std::ffi::c_int;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::hostile::pair;
use crate::phases::within;
use crate::plugin::Plugin;

const W: Duration = Duration::from_secs(120);

fn wait_for(var: &str) -> Result<(), String> {
    let path = std::env::var(var).map_err(|_| format!("{var} names no file"))?;
    let t = Instant::now();
    while !Path::new(&path).exists() {
        if t.elapsed() > Duration::from_secs(600) {
            return Err(format!("{path} never appeared"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Moves the bytes, says how many, serves until told to stop.
pub fn run(p: &Plugin, size: usize, iters: usize) -> Result<(), String> {
    let (mut h, l) = p.listen(0)?;
    let (s, r) = pair(p, &mut h, l)?;
    p.close_listen(l)?;
    let mut src = vec![0u8; size];
    let mut dst = vec![0u8; size];
    let (ms, mr) = (p.reg(s, &mut src)?, p.reg(r, &mut dst)?);
    wait_for("GPUDIRECT_METRICS_GO")?;
    for k in 0..iters {
        for (i, b) in src.iter_mut().enumerate() {
            *b = (k.wrapping_mul(13) ^ i) as u8;
        }
        let rr = within(W, "irecv got no request", || p.irecv(r, &mut [(dst.as_mut_ptr(), size, k as c_int, mr)]))?;
        let sr = within(W, "isend found no receive", || p.isend(s, src.as_mut_ptr(), size, k as c_int, ms))?;
        p.wait(sr, W)?;
        let got = p.wait(rr, W)?;
        if got[0] as usize != size || dst != src {
            return Err(format!("message {k}: {} bytes, or a byte not as sent", got[0]));
        }
    }
    let moved = (size * iters) as u64;
    println!("MOVED {{\"out_host\": {moved}, \"in_host\": {moved}}}");
    wait_for("GPUDIRECT_METRICS_STOP")?;
    p.dereg(s, ms)?;
    p.dereg(r, mr)?;
    p.close_send(s)?;
    p.close_recv(r)
}
