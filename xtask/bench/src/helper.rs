//! Processes the bench starts besides the tools: small target servers, and many
//! simulated edges registered on one cloud. Each runs in its own process so its memory,
//! CPU and file descriptors are not counted against the tunnel's.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};

use crate::simedge;

#[derive(Args, Clone, Debug)]
pub struct HelperArgs {
    #[command(subcommand)]
    pub kind: HelperKind,
}

#[derive(Subcommand, Clone, Debug)]
pub enum HelperKind {
    /// Target servers behind the edge.
    Servers {
        /// HTTP/1.1 server writing each response in two writes: head, then body.
        #[arg(long)]
        two_write: SocketAddr,
        /// Echo server (idle connections send a byte, get it back, then hold).
        #[arg(long)]
        echo: SocketAddr,
        /// Writes without end to whoever connects (bulk source for isolation).
        #[arg(long)]
        source: SocketAddr,
    },
    /// N simulated edges, each with its own TLS connection to the cloud.
    SimEdges {
        /// The clouds to dial (comma-separated): edge `i` dials the `i % len`th first,
        /// another when its connection ends.
        #[arg(long, value_delimiter = ',')]
        cloud: Vec<SocketAddr>,
        /// Index of the first simulated edge (`sim-<first>`).
        #[arg(long, default_value_t = 0)]
        first: usize,
        /// CA of the cloud's certificate.
        #[arg(long)]
        ca: PathBuf,
        /// The token of every simulated edge (`sim-00000` ..., each a line of the
        /// cloud's token file).
        #[arg(long, required_unless_present = "certs", conflicts_with = "certs")]
        token: Option<String>,
        /// Instead of the token: a client certificate for each edge, issued by the
        /// `tunnel certs` CA in this directory.
        #[arg(long)]
        certs: Option<PathBuf>,
        #[arg(long)]
        n: usize,
        /// Registrations in flight at once.
        #[arg(long, default_value_t = 128)]
        concurrency: usize,
        /// Dial only once this file exists (the bench makes it when every simulator
        /// has its certificates), so that all start at once.
        #[arg(long)]
        start_file: Option<PathBuf>,
        /// Exit after this many seconds whatever happens.
        #[arg(long, default_value_t = 300)]
        max_secs: u64,
    },
    /// TCP listeners that carry each connection through an HTTP CONNECT proxy on a unix
    /// socket (the tunnel's `connect.unix`, Konnectivity's `--uds-name`), for the load
    /// tools, which speak neither.
    ConnectFront {
        /// The proxy's unix socket.
        #[arg(long)]
        socket: PathBuf,
        /// `LISTEN=AUTHORITY`: connections accepted on LISTEN are CONNECTed to
        /// AUTHORITY (repeatable).
        #[arg(long = "map", value_name = "LISTEN=AUTHORITY")]
        maps: Vec<String>,
    },
}

pub fn main(args: &HelperArgs) -> Result<()> {
    crate::procs::raise_nofile();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    match &args.kind {
        HelperKind::Servers {
            two_write,
            echo,
            source,
        } => rt.block_on(servers::run(*two_write, *echo, *source)),
        HelperKind::SimEdges {
            cloud,
            first,
            ca,
            token,
            certs,
            n,
            concurrency,
            start_file,
            max_secs,
        } => {
            let max = std::time::Duration::from_secs(*max_secs);
            let credential = match (token, certs) {
                (_, Some(dir)) => simedge::Credential::Certificate(dir.clone()),
                (Some(token), None) => simedge::Credential::Token(token.clone()),
                (None, None) => bail!("--token or --certs"),
            };
            rt.block_on(async {
                match tokio::time::timeout(
                    max,
                    sim_edges(
                        cloud,
                        *first,
                        ca,
                        &credential,
                        *n,
                        *concurrency,
                        start_file.as_deref(),
                    ),
                )
                .await
                {
                    Ok(r) => r,
                    Err(_) => Ok(()),
                }
            })
        }
        HelperKind::ConnectFront { socket, maps } => {
            let maps = maps
                .iter()
                .map(|m| {
                    let (listen, authority) = m
                        .split_once('=')
                        .with_context(|| format!("--map {m}: expected LISTEN=AUTHORITY"))?;
                    Ok((listen.parse()?, authority.to_string()))
                })
                .collect::<Result<Vec<(SocketAddr, String)>>>()?;
            rt.block_on(front::run(socket.clone(), maps))
        }
    }
}

/// Runs [`simedge::Fleet`]'s edges and reports on stdout, one line each: `issued <n>
/// <ms>` once their credentials are made (certificates issued), then, once
/// `start_file` exists, `registering <welcomed> failed <n>` every second until
/// `registered <n> <ms>` when all n edges are welcomed (ms since the first dial; the
/// cloud starts the heartbeat right after), then every 200 ms `pings
/// <total> failed <n> rereg <n> last <unix ms> full <n>`: `rereg` counts the edges
/// welcomed again after their connection ended, `last` when the latest was, `full` the
/// registrations a full replica refused.
async fn sim_edges(
    clouds: &[SocketAddr],
    first: usize,
    ca: &Path,
    credential: &simedge::Credential,
    n: usize,
    concurrency: usize,
    start_file: Option<&Path>,
) -> Result<()> {
    let issuing = Instant::now();
    let fleet = simedge::Fleet::new(clouds, first, ca, credential, n)?;
    println!("issued {n} {}", issuing.elapsed().as_millis());
    if let Some(file) = start_file {
        while !file.exists() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let started = Instant::now();
    let stats = fleet.start(concurrency).await?;
    // Registered means the cloud opened the control stream: its session is up.
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut told = Instant::now();
    loop {
        let (done, failed) = (
            stats.registered.load(Ordering::Relaxed),
            stats.failed.load(Ordering::Relaxed),
        );
        if done as usize == n {
            println!("registered {n} {}", started.elapsed().as_millis());
            break;
        }
        if Instant::now() > deadline {
            bail!("only {done} of {n} simulated edges registered ({failed} attempts failed)");
        }
        if told.elapsed() >= Duration::from_secs(1) {
            told = Instant::now();
            println!("registering {done} failed {failed}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        println!(
            "pings {} failed {} rereg {} last {} full {}",
            stats.pings.load(Ordering::Relaxed),
            stats.failed.load(Ordering::Relaxed),
            stats.reregistered.load(Ordering::Relaxed),
            stats.last_rereg_ms.load(Ordering::Relaxed),
            stats.refused_full.load(Ordering::Relaxed),
        );
    }
}

mod servers {
    use std::net::SocketAddr;

    use anyhow::Result;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    pub async fn run(two_write: SocketAddr, echo: SocketAddr, source: SocketAddr) -> Result<()> {
        let tw = TcpListener::bind(two_write).await?;
        let ec = TcpListener::bind(echo).await?;
        let so = TcpListener::bind(source).await?;
        tokio::spawn(accept_loop(tw, |s| Box::pin(serve_two_write(s))));
        tokio::spawn(accept_loop(ec, |s| Box::pin(serve_echo(s))));
        tokio::spawn(accept_loop(so, |s| Box::pin(serve_source(s))));
        println!("ready");
        std::future::pending::<()>().await;
        Ok(())
    }

    type Serve =
        fn(TcpStream) -> std::pin::Pin<Box<dyn Future<Output = std::io::Result<()>> + Send>>;

    async fn accept_loop(listener: TcpListener, serve: Serve) {
        loop {
            match listener.accept().await {
                Ok((s, _)) => {
                    let _ = s.set_nodelay(true);
                    tokio::spawn(serve(s));
                }
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
            }
        }
    }

    /// Keep-alive HTTP/1.1: for each request head, the response head in one write and the
    /// body in a second. With Nagle on any hop, the second write waits for an ACK.
    async fn serve_two_write(mut s: TcpStream) -> std::io::Result<()> {
        const BODY: &[u8] = b"two writes: this body follows the head in its own write\n";
        let head = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n",
            BODY.len()
        );
        let mut buf = Vec::with_capacity(1024);
        let mut chunk = [0u8; 1024];
        loop {
            let n = s.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
            while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                buf.drain(..end + 4);
                s.write_all(head.as_bytes()).await?;
                s.write_all(BODY).await?;
            }
            if buf.len() > 64 * 1024 {
                return Ok(());
            }
        }
    }

    /// Echoes with a tiny buffer, so 10,000 idle connections cost it little.
    async fn serve_echo(mut s: TcpStream) -> std::io::Result<()> {
        let mut b = [0u8; 64];
        loop {
            let n = s.read(&mut b).await?;
            if n == 0 {
                return Ok(());
            }
            s.write_all(&b[..n]).await?;
        }
    }

    async fn serve_source(mut s: TcpStream) -> std::io::Result<()> {
        let block = vec![0x5au8; 256 * 1024];
        loop {
            s.write_all(&block).await?;
        }
    }
}

mod front {
    use std::io::ErrorKind;
    use std::net::SocketAddr;
    use std::path::PathBuf;
    use std::sync::Arc;

    use anyhow::{Result, bail};
    use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream, UnixStream};

    /// Read size of each direction; allocated only while data flows, so thousands of
    /// idle connections cost the front little.
    const CHUNK: usize = 64 * 1024;

    pub async fn run(socket: PathBuf, maps: Vec<(SocketAddr, String)>) -> Result<()> {
        let socket = Arc::new(socket);
        for (listen, authority) in maps {
            let listener = TcpListener::bind(listen).await?;
            let (socket, authority) = (socket.clone(), Arc::new(authority));
            tokio::spawn(async move {
                loop {
                    match listener.accept().await {
                        Ok((s, _)) => {
                            tokio::spawn(serve(s, socket.clone(), authority.clone()));
                        }
                        Err(_) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
                    }
                }
            });
        }
        println!("ready");
        std::future::pending::<()>().await;
        Ok(())
    }

    /// CONNECT, then bytes both ways until each side has closed. A refused CONNECT
    /// closes the client's connection.
    async fn serve(client: TcpStream, socket: Arc<PathBuf>, authority: Arc<String>) {
        let _ = async {
            client.set_nodelay(true)?;
            let mut proxy = UnixStream::connect(socket.as_path()).await?;
            proxy
                .write_all(
                    format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n").as_bytes(),
                )
                .await?;
            // The head, and whatever the target sent right behind it.
            let mut head = Vec::with_capacity(256);
            let mut chunk = [0u8; 1024];
            let end = loop {
                let n = proxy.read(&mut chunk).await?;
                if n == 0 || head.len() > 16 * 1024 {
                    bail!("CONNECT {authority}: no response head");
                }
                head.extend_from_slice(&chunk[..n]);
                if let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") {
                    break end + 4;
                }
            };
            if !head.starts_with(b"HTTP/1.1 200") && !head.starts_with(b"HTTP/1.0 200") {
                bail!("CONNECT {authority} refused");
            }
            let (client_rd, mut client_wr) = client.into_split();
            let (proxy_rd, proxy_wr) = proxy.into_split();
            client_wr.write_all(&head[end..]).await?;
            let up = pump(client_rd, proxy_wr);
            let down = pump(proxy_rd, client_wr);
            let _ = tokio::join!(up, down);
            anyhow::Ok(())
        }
        .await;
    }

    /// The read half of either socket, read only once it is readable.
    trait ReadHalf {
        async fn readable(&self) -> std::io::Result<()>;
        fn try_read(&self, buf: &mut [u8]) -> std::io::Result<usize>;
    }

    impl ReadHalf for tokio::net::tcp::OwnedReadHalf {
        async fn readable(&self) -> std::io::Result<()> {
            self.readable().await
        }
        fn try_read(&self, buf: &mut [u8]) -> std::io::Result<usize> {
            self.try_read(buf)
        }
    }

    impl ReadHalf for tokio::net::unix::OwnedReadHalf {
        async fn readable(&self) -> std::io::Result<()> {
            self.readable().await
        }
        fn try_read(&self, buf: &mut [u8]) -> std::io::Result<usize> {
            self.try_read(buf)
        }
    }

    /// One direction; shuts the writer down at EOF.
    async fn pump(rd: impl ReadHalf, mut wr: impl AsyncWrite + Unpin) -> std::io::Result<()> {
        let mut buf = Vec::new();
        loop {
            rd.readable().await?;
            if buf.is_empty() {
                buf = vec![0u8; CHUNK];
            }
            match rd.try_read(&mut buf) {
                Ok(0) => return wr.shutdown().await,
                Ok(n) => wr.write_all(&buf[..n]).await?,
                Err(e) if e.kind() == ErrorKind::WouldBlock => buf = Vec::new(),
                Err(e) => return Err(e),
            }
        }
    }
}
