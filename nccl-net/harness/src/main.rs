//! Drives `libnccl-net-gpudirect.so` as NCCL's proxy threads do, in two
//! processes (two Soft-RoCE guests in the bed) that exchange the plugin's
//! handles over their own TCP connection, as NCCL's bootstrap would.
//!
//! ```text
//! nccl-net-harness symbols [--plugin SO]
//! nccl-net-harness serve --port P [--plugin SO] [--die-after N]      # the receiving side
//! nccl-net-harness drive --peer HOST:P [--plugin SO] [--die-after N] # the sending side
//! nccl-net-harness drive --peer HOST:P --bench SIZE --iters N [--window W]  # bandwidth, MB/s
//! nccl-net-harness raw [--device rxe0] --iters N                     # the raw verbs baseline
//! nccl-net-harness hostile [--device rxe0]                            # the plugin against a hostile peer
//! nccl-net-harness threads [--iters N]                                # a proxy thread and a registering main thread
//! nccl-net-harness metrics --bench SIZE --iters N                     # traffic for a Prometheus scraping the plugin
//! ```
//!
//! `hostile` runs in one process on one device (see `hostile.rs`): a
//! member's raw-verbs queue pair reading and writing past what it was
//! offered, keys of another comm, claimed sizes and slots, stale handles,
//! and strangers' connections against a rank's setup time.
//!
//! `--window 1` keeps one message in flight (isend, then test until done):
//! what `testbed/nccl-net-perf` counts instructions of, against `raw`
//! (one signaled 64-byte RDMA write posted through the library's queue
//! pair and its completion polled, on a loopback pair in one process).
//!
//! Both sides run the same phases in order; every byte received is
//! checked. `--die-after N` makes that side exit abruptly after N messages
//! of the death phase, and the other side must then see an error, not hang.

mod hostile;
mod metrics;
mod phases;
mod plugin;
mod review;
mod threads;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use plugin::Plugin;

/// The control connection between the two processes.
pub struct Ctl(TcpStream);

impl Ctl {
    pub fn send(&mut self, b: &[u8]) {
        self.0.write_all(b).expect("control connection: write");
    }

    pub fn recv<const N: usize>(&mut self) -> [u8; N] {
        let mut b = [0u8; N];
        self.0.read_exact(&mut b).expect("control connection: read (did the other side fail?)");
        b
    }

    /// Both sides reach this point.
    pub fn sync(&mut self) {
        self.send(&[0x5a]);
        let [b] = self.recv::<1>();
        assert_eq!(b, 0x5a, "control connection out of step");
    }
}

struct Args {
    mode: String,
    plugin: String,
    port: u16,
    peer: String,
    die_after: Option<usize>,
    bench: Option<usize>,
    iters: usize,
    window: usize,
    device: String,
}

fn args() -> Args {
    let mut a = std::env::args().skip(1);
    let mode = a.next().unwrap_or_default();
    let exe = std::env::current_exe().expect("current_exe");
    let default_so = exe.parent().expect("exe dir").join("libnccl_net_gpudirect.so").display().to_string();
    let mut out = Args { mode, plugin: default_so, port: 18515, peer: String::new(), die_after: None, bench: None, iters: 200, window: 32, device: "rxe0".into() };
    while let Some(k) = a.next() {
        let mut v = || a.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--plugin" => out.plugin = v(),
            "--port" => out.port = v().parse().expect("--port"),
            "--peer" => out.peer = v(),
            "--die-after" => out.die_after = Some(v().parse().expect("--die-after")),
            "--bench" => out.bench = Some(v().parse().expect("--bench")),
            "--iters" => out.iters = v().parse().expect("--iters"),
            "--window" => out.window = v().parse::<usize>().expect("--window").clamp(1, 32),
            "--device" => out.device = v(),
            other => panic!("unknown argument {other}"),
        }
    }
    out
}

fn main() {
    let a = args();
    plugin::set_role(&a.mode);
    let result = match a.mode.as_str() {
        "symbols" => Plugin::load(&a.plugin).map(|_| println!("symbols: ncclNetPlugin_v8, _v9, _v10 and _v11 found, each named GPUDirect")),
        "serve" => serve(&a),
        "drive" => drive(&a),
        "raw" => phases::raw(&a.device, a.iters),
        // The project's own attacks, then an outside review's.
        "hostile" => open(&a).and_then(|p| {
            let own = hostile::run(&p, &a.device);
            let review = review::run(&p, &a.device);
            own.and(review)
        }),
        "threads" => open(&a).and_then(|p| threads::run(&p, a.iters)),
        "metrics" => open(&a).and_then(|p| metrics::run(&p, a.bench.unwrap_or(65536), a.iters)),
        _ => Err("usage: nccl-net-harness symbols|serve|drive|raw|hostile|threads|metrics [options]".into()),
    };
    if let Err(e) = result {
        eprintln!("[{}] FAILED: {e}", a.mode);
        std::process::exit(1);
    }
}

fn open(a: &Args) -> Result<Plugin, String> {
    let mut p = Plugin::load(&a.plugin)?;
    p.init()?;
    let n = p.devices()?;
    if n < 1 {
        return Err("the plugin reports no device".into());
    }
    let props = p.properties(0)?;
    if props.max_recvs != 8 || props.ptr_support & nccl_net_gpudirect::abi::PTR_HOST == 0 || props.max_p2p_bytes < (64 << 20) {
        return Err(format!("unexpected properties: {props:?}"));
    }
    Ok(p)
}

fn serve(a: &Args) -> Result<(), String> {
    let mut p = open(a)?;
    let listener = TcpListener::bind(("0.0.0.0", a.port)).map_err(|e| format!("control port {}: {e}", a.port))?;
    let (stream, _) = listener.accept().map_err(|e| e.to_string())?;
    let mut ctl = Ctl(stream);
    if let Some(size) = a.bench {
        return phases::bench_recv(&p, &mut ctl, size, a.iters);
    }
    if a.die_after.is_some() || std::env::var_os("HARNESS_PEER_DIES").is_some() {
        return phases::death_recv(&p, &mut ctl, a.die_after);
    }
    let t = Instant::now();
    phases::run_recv(&p, &mut ctl, a.die_after)?;
    p.finalize()?;
    println!("serve: all phases passed in {:.1} s", t.elapsed().as_secs_f64());
    Ok(())
}

fn drive(a: &Args) -> Result<(), String> {
    let mut p = open(a)?;
    let t0 = Instant::now();
    let stream = loop {
        match TcpStream::connect(&a.peer) {
            Ok(s) => break s,
            Err(e) if t0.elapsed() < Duration::from_secs(120) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => return Err(format!("control connection to {}: {e}", a.peer)),
        }
    };
    let mut ctl = Ctl(stream);
    if let Some(size) = a.bench {
        return phases::bench_send(&p, &mut ctl, size, a.iters, a.window);
    }
    if a.die_after.is_some() || std::env::var_os("HARNESS_PEER_DIES").is_some() {
        return phases::death_send(&p, &mut ctl, a.die_after);
    }
    let t = Instant::now();
    phases::run_send(&p, &mut ctl)?;
    p.finalize()?;
    println!("drive: all phases passed in {:.1} s", t.elapsed().as_secs_f64());
    Ok(())
}
