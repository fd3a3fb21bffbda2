"""The nginx configs in infra/nginx/ pass `nginx -t` (docs/fleet.md): the fleet test's rendered template,
and the production example with the shared proxy settings as the snippet it includes. Needs Debian's
nginx (infra/nginx-install, which `make test` runs); no server is started."""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.integration.nginx_harness import PROXY_CONF, nginx_binary, render

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "infra" / "nginx" / "chatplane.example.conf"
NGINX_T_TIMEOUT_S = 30

pytestmark = pytest.mark.skipif(nginx_binary() is None, reason="nginx is not installed (infra/nginx-install)")


def nginx_t(prefix: Path, conf: Path) -> subprocess.CompletedProcess[str]:
    binary = nginx_binary()
    assert binary
    return subprocess.run([binary, "-t", "-p", str(prefix), "-c", str(conf), "-g", f"pid {prefix / 'nginx.pid'};"],
                          capture_output=True, text=True, timeout=NGINX_T_TIMEOUT_S)


def self_signed(folder: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "api.chat.example")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + dt.timedelta(days=1)).sign(key, hashes.SHA256()))
    (folder / "fullchain.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "privkey.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))


def test_the_fleet_tests_rendered_template_passes_nginx_t(tmp_path):
    conf = tmp_path / "nginx.conf"
    conf.write_text(render(tmp_path, 18080, ["127.0.0.1:18081", "127.0.0.1:18082"]))
    r = nginx_t(tmp_path, conf)
    assert r.returncode == 0, r.stderr


def test_the_production_example_passes_nginx_t_with_the_shared_proxy_settings(tmp_path):
    # As installed: the site in the http context, the proxy settings as snippets/chatplane-proxy.conf
    # (relative to the prefix, as /etc/nginx/ is for the system's nginx), the certificates in place.
    (tmp_path / "snippets").mkdir()
    shutil.copy(PROXY_CONF, tmp_path / "snippets" / "chatplane-proxy.conf")
    self_signed(tmp_path)
    site = EXAMPLE.read_text().replace("/etc/ssl/chatplane/", f"{tmp_path}/")
    assert "include snippets/chatplane-proxy.conf;" in site
    (tmp_path / "site.conf").write_text(site)
    conf = tmp_path / "nginx.conf"
    conf.write_text(f"error_log {tmp_path}/error.log;\nevents {{}}\nhttp {{\n    include {tmp_path}/site.conf;\n}}\n")
    r = nginx_t(tmp_path, conf)
    assert r.returncode == 0, r.stderr
    # The settings SSE depends on are the ones nginx loaded (not commented out or overridden).
    proxy = PROXY_CONF.read_text()
    for line in ("proxy_buffering off;", "proxy_http_version 1.1;", 'proxy_set_header Connection "";', "proxy_read_timeout 180s;"):
        assert f"\n{line}" in proxy, line
