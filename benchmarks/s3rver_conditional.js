// s3rver with conditional PUTs: `node s3rver_conditional.js S3RVER_MODULE DIR PORT BUCKET`.
//
// Tansu's S3 storage coordinates through conditional writes (If-None-Match: * to create,
// If-Match: <etag> to update); s3rver 3.7 checks those headers on GET only, so a
// restarted broker, whose caches start empty, would overwrite a partition's watermark
// and its batches. This answers such a PUT 412 when its condition does not hold, the
// check and the write made atomic per key (one node process serves every request).
// A conditional PUT's body is read before its key is locked, so a client that dies
// mid-upload (a broker killed) holds up only its own request, and every object is written
// to a temporary file and renamed, and a GET reads it in one go, so a GET never serves
// half of it.
//
// It also lists from memory: Tansu lists a partition's whole records/ prefix on each fetch
// that finds new data, and s3rver's own listing walks the directory with blocking stat
// calls and reads each key's metadata files, a cost that grows with every batch stored.
// Here a sorted index of the bucket's keys, kept by this process's puts and deletes, and
// the listed keys' metadata, cached until their key is written again, answer a listing.
'use strict';

const crypto = require('crypto');
const fs = require('fs/promises');
const fsSync = require('fs');
const path = require('path');
const { Readable } = require('stream');

const [modulePath, directory, port, bucket] = process.argv.slice(2);
const S3rver = require(modulePath);
const S3Object = require(path.join(modulePath, 'lib', 'models', 'object'));

const buffered = new WeakMap(); // request -> its whole body, read before the lock
let temporaries = 0;

function readAll(req) {
  return new Promise((resolve, reject) => {
    const chunks = [];
    req.on('data', chunk => chunks.push(chunk));
    req.on('end', () => resolve(Buffer.concat(chunks)));
    req.on('error', reject);
    req.on('aborted', () => reject(new Error('client aborted the upload')));
  });
}

async function putBuffered(store, object, body) {
  const objectPath = store.getResourcePath(object.bucket, object.key, 'object');
  await fs.mkdir(path.dirname(objectPath), { recursive: true });
  const temporary = `${objectPath}.tmp-${process.pid}-${temporaries++}`;
  await fs.writeFile(temporary, body);
  await fs.rename(temporary, objectPath);
  const md5 = crypto.createHash('md5').update(body).digest('hex');
  await store.putMetadata(object.bucket, object.key, object.metadata, md5);
  return { size: body.length, md5 };
}

const tails = new Map(); // key -> promise of the last conditional PUT queued on it

function locked(key, run) {
  const previous = tails.get(key) || Promise.resolve();
  const current = previous.then(run, run);
  const tail = current.catch(() => {});
  tails.set(key, tail);
  tail.then(() => tails.get(key) === tail && tails.delete(key));
  return current;
}

function unquoted(etag) {
  return etag ? etag.replace(/^W\//, '').replace(/"/g, '') : etag;
}

async function currentEtag(store, bucketName, key) {
  try {
    return (await store.getMetadata(bucketName, key)).etag;
  } catch (err) {
    if (err.code === 'ENOENT') return undefined;
    throw err;
  }
}

async function conditionalPut(ctx, next) {
  const noneMatch = ctx.get('if-none-match');
  const match = ctx.get('if-match');
  if (ctx.method !== 'PUT' || (!noneMatch && !match)) return next();
  const [bucketName, ...rest] = decodeURIComponent(ctx.path).replace(/^\//, '').split('/');
  const key = rest.join('/');
  if (!key) return next();
  buffered.set(ctx.req, await readAll(ctx.req));
  return locked(`${bucketName}/${key}`, async () => {
    const etag = await currentEtag(ctx.store, bucketName, key);
    const failed =
      (noneMatch === '*' && etag !== undefined) ||
      (match && (etag === undefined || unquoted(match) !== unquoted(etag)));
    if (failed) {
      ctx.status = 412;
      ctx.type = 'application/xml';
      ctx.body =
        '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>PreconditionFailed</Code>' +
        '<Message>At least one of the pre-conditions you specified did not hold</Message>' +
        '</Error>';
      return;
    }
    await next();
  });
}

const server = new S3rver({
  address: '127.0.0.1',
  port: Number(port),
  directory,
  silent: true,
  configureBuckets: [{ name: bucket, configs: [] }],
});
// before the router (the last middleware), after s3rver's own request handling setup
server.middleware.splice(server.middleware.length - 1, 0, conditionalPut);
// a GET reads the object in one go and takes its length and etag from what it read:
// s3rver's own stats the file, then opens it, so a PUT renamed in between was served cut
// to the old length
async function getWhole(bucketName, key, options) {
  const objectPath = server.store.getResourcePath(bucketName, key, 'object');
  let handle;
  try {
    handle = await fs.open(objectPath);
  } catch (err) {
    if (err.code === 'ENOENT') return null;
    throw err;
  }
  let body, stat;
  try {
    [stat, body] = [await handle.stat(), await handle.readFile()];
  } finally {
    await handle.close();
  }
  let stored;
  try {
    const metadataPath = server.store.getResourcePath(bucketName, key, 'metadata.json');
    stored = JSON.parse(await fs.readFile(metadataPath));
  } catch (err) {
    if (err.code !== 'ENOENT') throw err;
  }
  const metadata = {
    ...stored,
    etag: JSON.stringify(crypto.createHash('md5').update(body).digest('hex')),
    'last-modified': stat.mtime.toUTCString(),
    'content-length': body.length,
  };
  const lastByte = Math.max(0, body.length - 1);
  const range = {
    start: (options && options.start) || 0,
    end: Math.min((options && options.end) || Infinity, lastByte),
  };
  const ranged = options && (options.start !== undefined || options.end);
  if (range.start < 0 || range.end < range.start) {
    const object = new S3Object(bucketName, key, null, metadata);
    if (ranged) object.range = range;
    return object;
  }
  const content = Readable.from([body.subarray(range.start, range.end + 1)]);
  const object = new S3Object(bucketName, key, content, metadata);
  if (ranged) object.range = range;
  return object;
}
server.store.getObject = getWhole;

// every PUT, conditional or not, is written whole and renamed into place: a GET racing
// a PUT of its key (a group's state, rewritten on each member's heartbeat) reads the old
// object or the new one, never an empty or partial file
server.store.putObject = async object => {
  let body = buffered.get(object.content);
  if (body === undefined) {
    body = Buffer.isBuffer(object.content) ? object.content : await readAll(object.content);
  }
  return putBuffered(server.store, object, body);
};

const OBJECT_SUFFIX = '._S3rver_object';
const keys = new Map(); // bucket -> its keys, sorted
const metadataCache = new Map(); // `${bucket}/${key}` -> what store.getMetadata answered

function walkKeys(root, dir, found) {
  for (const entry of fsSync.readdirSync(dir, { withFileTypes: true })) {
    const full = path.join(dir, entry.name);
    if (entry.isDirectory()) walkKeys(root, full, found);
    else if (entry.name.endsWith(OBJECT_SUFFIX)) {
      found.push(path.relative(root, full).slice(0, -OBJECT_SUFFIX.length));
    }
  }
  return found;
}

function bucketKeys(bucketName) {
  let sorted = keys.get(bucketName);
  if (sorted === undefined) {
    const root = server.store.getBucketPath(bucketName);
    sorted = fsSync.existsSync(root) ? walkKeys(root, root, []).sort(compare) : [];
    keys.set(bucketName, sorted);
  }
  return sorted;
}

function compare(a, b) {
  return a < b ? -1 : a > b ? 1 : 0;
}

function firstAtOrAfter(sorted, key) {
  let low = 0;
  let high = sorted.length;
  while (low < high) {
    const mid = (low + high) >>> 1;
    if (sorted[mid] < key) low = mid + 1;
    else high = mid;
  }
  return low;
}

function indexed(bucketName, key) {
  const sorted = bucketKeys(bucketName);
  const at = firstAtOrAfter(sorted, key);
  if (sorted[at] !== key) sorted.splice(at, 0, key);
}

function unindexed(bucketName, key) {
  const sorted = bucketKeys(bucketName);
  const at = firstAtOrAfter(sorted, key);
  if (sorted[at] === key) sorted.splice(at, 1);
}

async function cachedMetadata(bucketName, key) {
  const id = `${bucketName}/${key}`;
  let metadata = metadataCache.get(id);
  if (metadata === undefined) {
    metadata = await server.store.getMetadata(bucketName, key);
    metadataCache.set(id, metadata);
  }
  return metadata;
}

// the same answer as s3rver's FilesystemStore.listObjects, from the index
async function listObjects(bucketName, options) {
  const { delimiter = '', startAfter = '', prefix = '', maxKeys = Infinity } = options;
  const sorted = bucketKeys(bucketName);
  const commonPrefixes = new Set();
  const listed = [];
  let isTruncated = false;
  for (let i = firstAtOrAfter(sorted, prefix); i < sorted.length; i++) {
    const key = sorted[i];
    if (!key.startsWith(prefix)) break;
    if (key <= startAfter) continue;
    if (delimiter) {
      const at = key.slice(prefix.length).indexOf(delimiter);
      if (at !== -1) {
        commonPrefixes.add(key.slice(0, prefix.length + at + 1));
        continue;
      }
    }
    if (listed.length < maxKeys) listed.push(key);
    else {
      isTruncated = true;
      break;
    }
  }
  const objects = [];
  for (const key of listed) {
    try {
      objects.push(new S3Object(bucketName, key, null, await cachedMetadata(bucketName, key)));
    } catch (err) {
      if (err.code !== 'ENOENT') throw err;
    }
  }
  return { objects, commonPrefixes: [...commonPrefixes].sort(), isTruncated };
}

function keeping(method, update) {
  const original = server.store[method].bind(server.store);
  server.store[method] = async (...args) => {
    const [bucketName, key] = update(...args);
    metadataCache.delete(`${bucketName}/${key}`);
    try {
      return await original(...args);
    } finally {
      metadataCache.delete(`${bucketName}/${key}`);
      if (method === 'deleteObject') unindexed(bucketName, key);
      else if (fsSync.existsSync(server.store.getResourcePath(bucketName, key, 'object'))) {
        indexed(bucketName, key);
      }
    }
  };
}

keeping('putObject', object => [object.bucket, object.key]);
keeping('copyObject', (srcBucket, srcKey, destBucket, destKey) => [destBucket, destKey]);
keeping('deleteObject', (bucketName, key) => [bucketName, key]);
// a completed multipart upload names its key only in the upload's own records: the
// bucket's index and cache are rebuilt on its next listing
const putObjectMultipart = server.store.putObjectMultipart.bind(server.store);
server.store.putObjectMultipart = async (bucketName, ...rest) => {
  try {
    return await putObjectMultipart(bucketName, ...rest);
  } finally {
    keys.delete(bucketName);
    metadataCache.clear();
  }
};
server.store.listObjects = listObjects;

server.run().then(
  () => console.log(`s3rver on 127.0.0.1:${port}, ${directory}, conditional PUTs`),
  err => {
    console.error(err);
    process.exit(1);
  },
);
