// Safe Markdown for model answers: a small subset rendered as DOM nodes.
//
// No string of the answer ever reaches innerHTML: every piece of text becomes a Text node, and the
// only elements are the ones built here (p, h1-h4, ul/ol/li, pre/code, blockquote, strong, em, code,
// a). So "<img src=x onerror=...>" in an answer is shown as those characters. Links keep only http(s)
// targets and open with rel="noopener noreferrer nofollow"; anything else stays text.
//
// Subset: fenced code blocks (```), ATX headings (#..####), bullet and numbered lists, block quotes,
// paragraphs; inline `code`, **strong**, *em* / _em_, [text](http(s)://...). An unclosed fence (an
// answer still streaming) renders as a code block to the end, so text never jumps between forms.

function el(doc, tag, cls) {
  const e = doc.createElement(tag);
  if (cls) e.className = cls;
  return e;
}

// The source of the inline pattern; each call makes its own RegExp (a shared global one would have
// its lastIndex reset by the nested calls for strong and em).
const INLINE = String.raw`(\`+)([^\`]*?)\1|\*\*([^*]+?)\*\*|\*([^*\s][^*]*?)\*|_([^_\s][^_]*?)_|\[([^\]]+)\]\(([^)\s]+)\)`;

export function renderInline(doc, parent, text) {
  let last = 0;
  const re = new RegExp(INLINE, "g");
  for (let m = re.exec(text); m !== null; m = re.exec(text)) {
    if (m.index > last) parent.appendChild(doc.createTextNode(text.slice(last, m.index)));
    if (m[1] !== undefined) {
      const c = el(doc, "code");
      c.textContent = m[2];
      parent.appendChild(c);
    } else if (m[3] !== undefined) {
      const s = el(doc, "strong");
      renderInline(doc, s, m[3]);
      parent.appendChild(s);
    } else if (m[4] !== undefined || m[5] !== undefined) {
      const e = el(doc, "em");
      renderInline(doc, e, m[4] !== undefined ? m[4] : m[5]);
      parent.appendChild(e);
    } else if (m[6] !== undefined) {
      const href = m[7];
      if (/^https?:\/\//i.test(href)) {
        const a = el(doc, "a");
        a.href = href;
        a.rel = "noopener noreferrer nofollow";
        a.target = "_blank";
        a.textContent = m[6];
        parent.appendChild(a);
      } else {
        parent.appendChild(doc.createTextNode(m[0]));
      }
    }
    last = re.lastIndex;
  }
  if (last < text.length) parent.appendChild(doc.createTextNode(text.slice(last)));
}

// Render `source` into `target` (its children are replaced).
export function renderMarkdown(target, source) {
  const doc = target.ownerDocument;
  const frag = doc.createDocumentFragment();
  const lines = String(source).replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  let para = [];
  const flush = () => {
    if (para.length) {
      const p = el(doc, "p");
      para.forEach((line, k) => {
        if (k) p.appendChild(el(doc, "br"));
        renderInline(doc, p, line);
      });
      frag.appendChild(p);
      para = [];
    }
  };
  while (i < lines.length) {
    const line = lines[i];
    const fence = /^\s*```\s*([\w+-]*)\s*$/.exec(line);
    if (fence) {
      flush();
      const pre = el(doc, "pre");
      const code = el(doc, "code");
      if (fence[1]) code.dataset.lang = fence[1];
      const body = [];
      i += 1;
      while (i < lines.length && !/^\s*```\s*$/.test(lines[i])) body.push(lines[i++]);
      i += 1; // the closing fence (or past the end)
      code.textContent = body.join("\n");
      pre.appendChild(code);
      frag.appendChild(pre);
      continue;
    }
    const heading = /^(#{1,4})\s+(.*)$/.exec(line);
    if (heading) {
      flush();
      const h = el(doc, "h" + heading[1].length);
      renderInline(doc, h, heading[2]);
      frag.appendChild(h);
      i += 1;
      continue;
    }
    const item = /^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/.exec(line);
    if (item) {
      flush();
      const ordered = /\d/.test(item[1]);
      const list = el(doc, ordered ? "ol" : "ul");
      while (i < lines.length) {
        const m = /^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/.exec(lines[i]);
        if (!m || /\d/.test(m[1]) !== ordered) break;
        const li = el(doc, "li");
        renderInline(doc, li, m[2]);
        list.appendChild(li);
        i += 1;
      }
      frag.appendChild(list);
      continue;
    }
    if (/^>\s?/.test(line)) {
      flush();
      const q = el(doc, "blockquote");
      const body = [];
      while (i < lines.length && /^>\s?/.test(lines[i])) body.push(lines[i++].replace(/^>\s?/, ""));
      renderMarkdown(q, body.join("\n"));
      frag.appendChild(q);
      continue;
    }
    if (line.trim() === "") {
      flush();
    } else {
      para.push(line);
    }
    i += 1;
  }
  flush();
  target.replaceChildren(frag);
}
