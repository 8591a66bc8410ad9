//! Processes the bench starts besides the tools: small target servers, and many
//! simulated edges registered on one cloud. Each runs in its own process so its memory,
//! CPU and file descriptors are not counted against the tunnel's.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Subcommand};

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
        #[arg(long)]
        cloud: SocketAddr,
        /// CA of the cloud's certificate.
        #[arg(long)]
        ca: PathBuf,
        /// Token valid for any node (`default:` line of the cloud's token file).
        #[arg(long)]
        token: String,
        #[arg(long)]
        n: usize,
        /// Registrations in flight at once.
        #[arg(long, default_value_t = 128)]
        concurrency: usize,
        /// Exit after this many seconds whatever happens.
        #[arg(long, default_value_t = 300)]
        max_secs: u64,
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
            ca,
            token,
            n,
            concurrency,
            max_secs,
        } => {
            let max = std::time::Duration::from_secs(*max_secs);
            rt.block_on(async {
                match tokio::time::timeout(
                    max,
                    super::simedge::run(*cloud, ca, token, *n, *concurrency),
                )
                .await
                {
                    Ok(r) => r,
                    Err(_) => Ok(()),
                }
            })
        }
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
