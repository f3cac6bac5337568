"""KServe v2 over HTTP (aiohttp): routes, bodies, codecs and the JSON worker processes."""
