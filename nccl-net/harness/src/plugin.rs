//! The plugin as NCCL sees it: loaded with dlopen, called through its
//! tables, its log lines caught by a logger like NCCL's.

use std::ffi::{c_char, c_int, c_ulong, c_void, CStr, CString};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nccl_net_gpudirect::abi::*;

extern "C" {
    fn harness_logger(level: c_int, flags: c_ulong, file: *const c_char, line: c_int, fmt: *const c_char, ...);
}

static LINES: Mutex<Vec<(c_int, String)>> = Mutex::new(Vec::new());
static ROLE: Mutex<String> = Mutex::new(String::new());

/// Called by logger.c with each formatted line.
#[no_mangle]
extern "C" fn harness_log_line(level: c_int, _flags: c_ulong, text: *const c_char) {
    // SAFETY: logger.c passes a NUL-terminated buffer.
    let text = unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned();
    let kind = if level == LOG_WARN { "WARN" } else { "INFO" };
    eprintln!("[{}] NCCL {kind} {text}", ROLE.lock().unwrap());
    LINES.lock().unwrap().push((level, text));
}

/// The log lines so far that contain `needle`.
pub fn logged(needle: &str) -> Vec<String> {
    LINES.lock().unwrap().iter().filter(|(_, t)| t.contains(needle)).map(|(_, t)| t.clone()).collect()
}

/// Names this process in its log lines.
pub fn set_role(role: &str) {
    *ROLE.lock().unwrap() = role.to_owned();
}

/// The plugin, loaded.
pub struct Plugin {
    lib: *mut c_void,
    pub v11: &'static NetV11,
    pub v8: &'static NetV8,
    ctx: Ptr,
}

fn code(what: &str, rc: NcclResult) -> Result<(), String> {
    if rc == SUCCESS {
        Ok(())
    } else {
        Err(format!("{what} returned ncclResult {rc}"))
    }
}

impl Plugin {
    /// dlopens `path` and checks every table NCCL looks for.
    pub fn load(path: &str) -> Result<Plugin, String> {
        let c = CString::new(path).map_err(|e| e.to_string())?;
        // SAFETY: dlopen of a path; the library stays loaded for the process.
        let lib = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if lib.is_null() {
            // SAFETY: dlerror's string is valid until the next dl call.
            return Err(format!("dlopen {path}: {}", unsafe { CStr::from_ptr(libc::dlerror()) }.to_string_lossy()));
        }
        let sym = |name: &CStr| -> Result<*mut c_void, String> {
            // SAFETY: looking a symbol up in a loaded library.
            let p = unsafe { libc::dlsym(lib, name.as_ptr()) };
            if p.is_null() {
                Err(format!("{path} exports no {}", name.to_string_lossy()))
            } else {
                Ok(p)
            }
        };
        for name in [c"ncclNetPlugin_v8", c"ncclNetPlugin_v9", c"ncclNetPlugin_v10", c"ncclNetPlugin_v11"] {
            let table = sym(name)?;
            // SAFETY: every table starts with its name (const char*).
            let tname = unsafe { CStr::from_ptr(*(table as *const *const c_char)) };
            if tname != c"GPUDirect" {
                return Err(format!("{}'s name is {tname:?}, not GPUDirect", name.to_string_lossy()));
            }
        }
        // SAFETY: the symbols are the plugin's statics of these types.
        let v11 = unsafe { &*(sym(c"ncclNetPlugin_v11")? as *const NetV11) };
        // SAFETY: as above.
        let v8 = unsafe { &*(sym(c"ncclNetPlugin_v8")? as *const NetV8) };
        Ok(Plugin { lib, v11, v8, ctx: std::ptr::null_mut() })
    }

    /// init (v11), as NCCL calls it per communicator.
    pub fn init(&mut self) -> Result<(), String> {
        let mut cfg = CommConfig { traffic_class: -1 };
        // SAFETY: the plugin's init with valid out pointers and our logger.
        code("init", unsafe { (self.v11.init)(&mut self.ctx, 1, &mut cfg, Some(harness_logger), None) })?;
        // NCCL 2.19 would call the v8 table's: the same process state.
        // SAFETY: as above.
        code("init v8", unsafe { (self.v8.init)(Some(harness_logger)) })
    }

    /// Listens through the v8 table (NCCL 2.19's calling convention).
    pub fn listen_v8(&self) -> Result<([u8; HANDLE_MAXSIZE], Ptr), String> {
        let mut h = [0u8; HANDLE_MAXSIZE];
        let mut l = std::ptr::null_mut();
        // SAFETY: a 128-byte handle and an out pointer.
        code("listen v8", unsafe { (self.v8.listen)(0, h.as_mut_ptr().cast(), &mut l) })?;
        Ok((h, l))
    }

    /// One connect or accept call through the v8 table: the comm or null.
    pub fn connect_or_accept_v8(&self, handle: Option<&mut [u8; HANDLE_MAXSIZE]>, listen: Ptr) -> Result<Ptr, String> {
        let mut c = std::ptr::null_mut();
        let mut d = std::ptr::null_mut();
        // SAFETY: NCCL's calling convention, through the v8 table.
        let rc = unsafe {
            match handle {
                Some(h) => (self.v8.connect)(0, h.as_mut_ptr().cast(), &mut c, &mut d),
                None => (self.v8.accept)(listen, &mut c, &mut d),
            }
        };
        code("connect/accept v8", rc)?;
        Ok(c)
    }

    /// One isend (n = None) or one-receive irecv through the v8 table, with int sizes.
    pub fn post_v8(&self, comm: Ptr, data: *mut u8, size: c_int, tag: c_int, m: Ptr, recv: bool) -> Result<Ptr, String> {
        let mut r = std::ptr::null_mut();
        let (mut d, mut s, mut t, mut mh) = (data.cast::<c_void>(), size, tag, m);
        // SAFETY: one-element arrays, registered memory, an out pointer.
        let rc = unsafe {
            if recv {
                (self.v8.irecv)(comm, 1, &mut d, &mut s, &mut t, &mut mh, &mut r)
            } else {
                (self.v8.isend)(comm, d, s, t, mh, &mut r)
            }
        };
        code("isend/irecv v8", rc)?;
        Ok(r)
    }

    pub fn devices(&self) -> Result<c_int, String> {
        let mut n = 0;
        // SAFETY: valid out pointer.
        code("devices", unsafe { (self.v11.devices)(&mut n) })?;
        Ok(n)
    }

    pub fn properties(&self, dev: c_int) -> Result<PropertiesV11, String> {
        // SAFETY: all-zero is a valid value of this plain C struct.
        let mut p: PropertiesV11 = unsafe { std::mem::zeroed() };
        // SAFETY: valid out pointer.
        code("getProperties", unsafe { (self.v11.get_properties)(dev, &mut p) })?;
        Ok(p)
    }

    pub fn listen(&self, dev: c_int) -> Result<([u8; HANDLE_MAXSIZE], Ptr), String> {
        let mut h = [0u8; HANDLE_MAXSIZE];
        let mut l = std::ptr::null_mut();
        // SAFETY: a 128-byte handle and an out pointer.
        code("listen", unsafe { (self.v11.listen)(self.ctx, 0.max(dev), h.as_mut_ptr().cast(), &mut l) })?;
        Ok((h, l))
    }

    /// connect until it returns a comm (or fails, or `within` passes).
    pub fn connect(&self, dev: c_int, handle: &mut [u8; HANDLE_MAXSIZE], within: Duration) -> Result<Ptr, String> {
        let t = Instant::now();
        loop {
            let mut c = std::ptr::null_mut();
            let mut d = std::ptr::null_mut();
            // SAFETY: NCCL's calling convention: the same handle each time.
            code("connect", unsafe { (self.v11.connect)(self.ctx, dev, handle.as_mut_ptr().cast(), &mut c, &mut d) })?;
            if !c.is_null() {
                return Ok(c);
            }
            if t.elapsed() > within {
                return Err(format!("connect returned no comm within {within:?}"));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// One accept call.
    pub fn accept_once(&self, l: Ptr) -> Result<Ptr, String> {
        let mut c = std::ptr::null_mut();
        let mut d = std::ptr::null_mut();
        // SAFETY: a live listen comm and out pointers.
        code("accept", unsafe { (self.v11.accept)(l, &mut c, &mut d) })?;
        Ok(c)
    }

    pub fn accept(&self, l: Ptr, within: Duration) -> Result<Ptr, String> {
        let t = Instant::now();
        loop {
            let c = self.accept_once(l)?;
            if !c.is_null() {
                return Ok(c);
            }
            if t.elapsed() > within {
                return Err(format!("accept returned no comm within {within:?}"));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    pub fn reg(&self, comm: Ptr, buf: &mut [u8]) -> Result<Ptr, String> {
        let mut m = std::ptr::null_mut();
        // SAFETY: the buffer outlives the registration (deregistered before it is dropped).
        code("regMr", unsafe { (self.v11.reg_mr)(comm, buf.as_mut_ptr().cast(), buf.len(), PTR_HOST, &mut m) })?;
        Ok(m)
    }

    pub fn dereg(&self, comm: Ptr, m: Ptr) -> Result<(), String> {
        // SAFETY: a handle reg returned.
        code("deregMr", unsafe { (self.v11.dereg_mr)(comm, m) })
    }

    /// One isend call: the request or null.
    pub fn isend(&self, comm: Ptr, data: *mut u8, size: usize, tag: c_int, m: Ptr) -> Result<Ptr, String> {
        let mut r = std::ptr::null_mut();
        // SAFETY: registered memory and an out pointer.
        code("isend", unsafe { (self.v11.isend)(comm, data.cast(), size, tag, m, std::ptr::null_mut(), &mut r) })?;
        Ok(r)
    }

    /// One irecv call: the request or null.
    pub fn irecv(&self, comm: Ptr, bufs: &mut [(*mut u8, usize, c_int, Ptr)]) -> Result<Ptr, String> {
        let mut data: Vec<Ptr> = bufs.iter().map(|b| b.0.cast()).collect();
        let mut sizes: Vec<usize> = bufs.iter().map(|b| b.1).collect();
        let mut tags: Vec<c_int> = bufs.iter().map(|b| b.2).collect();
        let mut mh: Vec<Ptr> = bufs.iter().map(|b| b.3).collect();
        let mut ph: Vec<Ptr> = vec![std::ptr::null_mut(); bufs.len()];
        let mut r = std::ptr::null_mut();
        // SAFETY: arrays of n elements and an out pointer.
        code("irecv", unsafe {
            (self.v11.irecv)(comm, bufs.len() as c_int, data.as_mut_ptr(), sizes.as_mut_ptr(), tags.as_mut_ptr(), mh.as_mut_ptr(), ph.as_mut_ptr(), &mut r)
        })?;
        Ok(r)
    }

    /// One test call: the sizes once done.
    pub fn test(&self, req: Ptr) -> Result<Option<[c_int; 8]>, String> {
        let mut done = 0;
        let mut sizes = [-1; 8];
        // SAFETY: a live request and out pointers of room for 8 sizes.
        code("test", unsafe { (self.v11.test)(req, &mut done, sizes.as_mut_ptr()) })?;
        Ok((done != 0).then_some(sizes))
    }

    pub fn wait(&self, req: Ptr, within: Duration) -> Result<[c_int; 8], String> {
        let t = Instant::now();
        loop {
            if let Some(s) = self.test(req)? {
                return Ok(s);
            }
            if t.elapsed() > within {
                return Err(format!("a request did not complete within {within:?}"));
            }
        }
    }

    pub fn close_send(&self, c: Ptr) -> Result<(), String> {
        // SAFETY: a comm connect returned.
        code("closeSend", unsafe { (self.v11.close_send)(c) })
    }

    pub fn close_recv(&self, c: Ptr) -> Result<(), String> {
        // SAFETY: a comm accept returned.
        code("closeRecv", unsafe { (self.v11.close_recv)(c) })
    }

    pub fn close_listen(&self, l: Ptr) -> Result<(), String> {
        // SAFETY: a listen comm.
        code("closeListen", unsafe { (self.v11.close_listen)(l) })
    }

    pub fn finalize(&mut self) -> Result<(), String> {
        // SAFETY: the context init made.
        let r = code("finalize", unsafe { (self.v11.finalize)(self.ctx) });
        self.ctx = std::ptr::null_mut();
        r
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        // The library stays loaded: NCCL never unloads a plugin either.
        let _ = self.lib;
    }
}
